// Pacer dashboard: one page, two views, no dependencies.
//
//   #/                 the jobs list (polled every 2 s)
//   #/jobs/<job>       one job (also served at /jobs/<job>): the record from
//                      GET api/v1/jobs/<job>, then live events from the
//                      stream api/v1/events?job=<job> (history first).
//
// Every URL is relative (to the page, or at /jobs/<job> to its <base href="../">),
// so the dashboard works behind a path prefix (an Ingress at /pacer/, a proxy).
//
// Every value is written with textContent (never innerHTML), so a job name
// or a reason cannot inject markup.  Elements that tests and scripts read
// have stable ids or data attributes: #job-state, #throughput[data-value],
// [data-node="worker-0"] [data-field="state"], #shards-done, #timeline li[data-kind].
//
// The API wants a bearer token.  The page asks for it on its sign-in view
// (#/login, shown whenever the page has no token or the API refused it), checks
// it with GET api/v1/whoami, keeps it in sessionStorage (this tab only) and sends
// it as `Authorization: Bearer` on every request, the event stream's included.
// A token never goes into a URL, where logs, proxies and history keep it: the API
// refuses ?access_token=, and a #token= fragment (what older `pacer up` printed)
// is wiped from the address bar and not used.  EventSource cannot set that header,
// so the stream is read with fetch() and parsed by EventStream below.
"use strict";

const TERMINAL = new Set(["completed", "failed", "stopped"]);
const JOB_STATES = ["submitted", "planning", "running", "completed", "failed", "stopped"];
const EVENT_NAMES = [
  "replayed",
  "job.plan", ...JOB_STATES.map((s) => "job." + s),
  "node.created", "node.running", "node.died", "node.finished",
  "executor.applied", "executor.failed", "executor.torn_down",
  "monitor.statistics",
  "shard.progress", "shard.registered", "shard.epoch_started", "shard.requeued", "shard.parked",
  "shard.finished", "shard.checkpointed", "shard.restored",
  "agent.metrics", "agent.heartbeat", "agent.action",
  "controller.decision", "brain.decision",
];
const SERIES_MAX = 300;     // throughput points kept for the chart
const TIMELINE_MAX = 400;   // timeline entries kept
const METRICS_FRESH_S = 30; // agent metrics older than this do not count in the fallback throughput

// ------------------------------------------------------------------ the API token

const TOKEN_KEY = "pacer.token";
let memToken = ""; // when sessionStorage is unavailable (privacy modes)
let signInNote = ""; // why the sign-in view is shown (a refused token, a token in the URL)

// A token in the address (#token=...) is wiped, never used: history has it already.
function scrubToken() {
  const m = location.hash.match(/^#token=[^&]*(?:&(.*))?$/);
  if (!m) return;
  history.replaceState(null, "", location.pathname + location.search + (m[1] ? "#" + m[1] : ""));
  signInNote = "A token in the address is not used (addresses end up in history and logs): sign in here.";
}

function token() {
  try { return sessionStorage.getItem(TOKEN_KEY) || memToken; } catch (e) { return memToken; }
}

function setToken(t) {
  memToken = t;
  try {
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch (e) { /* memToken serves */ }
}

function setWho(who) {
  const node = document.getElementById("who");
  if (!node) return;
  node.replaceChildren();
  node.hidden = !who;
  if (!who) return;
  const ns = who.namespaces.includes("*") ? "every namespace" : who.namespaces.join(", ");
  node.append(el("span", { id: "who-name", "data-role": who.role }, `${who.name} (${who.role}; ${ns})`), " ",
    el("button", { id: "logout", type: "button", onclick: signOut }, "Sign out"));
}

function signOut() {
  setToken("");
  setWho(null);
  signInNote = "Signed out.";
  route();
}

// ------------------------------------------------------------------ helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function setText(id, text) {
  const node = document.getElementById(id);
  if (node) node.textContent = text;
  return node;
}

function fmtNum(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
  return Number(v).toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
}

function fmtDur(s) {
  if (!(s >= 0)) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}

function fmtTime(ts) {
  if (!ts) return "-";
  const d = new Date(ts * 1000);
  const today = new Date().toDateString() === d.toDateString();
  const time = d.toLocaleTimeString("en-GB", { hour12: false });
  return today ? time : `${d.toISOString().slice(0, 10)} ${time}`;
}

function pct(done, total) {
  return total > 0 ? Math.min(100, (100 * done) / total) : 0;
}

function jobProgress(rec) {
  const p = rec.progress || {};
  if (p.records_total > 0) return pct(p.records_done, p.records_total);
  if (p.shards_total > 0) return pct(p.shards_done, p.shards_total);
  return rec.state === "completed" ? 100 : 0;
}

// Job completion time: submission to the end; while the job lives, the time so far.
function jct(rec) {
  if (!rec.submitted_at) return "-";
  if (rec.finished_at) return fmtDur(rec.finished_at - rec.submitted_at);
  if (TERMINAL.has(rec.state)) return "-";
  return fmtDur(Date.now() / 1000 - rec.submitted_at) + " so far";
}

async function api(method, path, body, type) {
  const opts = { method, headers: { Authorization: "Bearer " + token() } };
  if (body !== undefined) {
    opts.body = body;
    opts.headers["Content-Type"] = type || "application/json";
  }
  const resp = await fetch(path, opts);
  let data = null;
  try { data = await resp.json(); } catch (e) { data = null; }
  if (!resp.ok) {
    const err = (data && data.error) || { code: "http_" + resp.status, message: resp.statusText };
    const e = new Error(err.message);
    e.code = err.code;
    e.status = resp.status;
    if (resp.status === 401 && token() && !(current instanceof LoginView)) { // revoked or expired: sign in again
      setToken("");
      setWho(null);
      signInNote = `The API refused the token (${err.message}): sign in again.`;
      setTimeout(route, 0);
    }
    throw e;
  }
  return data;
}

// ------------------------------------------------------------------ the event stream

// Server-Sent Events over fetch(), with the bearer header: what EventSource does, in
// the part of the text/event-stream format (HTML standard, "Server-sent events") that
// matters here: `event:`, `data:` (joined by newlines), `id:`, `retry:`, comments, any
// line ending.  Like EventSource it reconnects after `retry` ms when the stream ends or
// the network fails, sending Last-Event-ID so the server resumes after the last event
// seen; unlike it, it gives up on a 4xx (a wrong token or job does not heal by retrying).
class EventStream {
  constructor(url, { onopen, onevent, onerror }) {
    this.url = url;
    this.onopen = onopen;
    this.onevent = onevent;
    this.onerror = onerror;
    this.lastId = "";      // the id of the last event dispatched: sent back on reconnecting
    this.retryMs = 2000;   // until the server says otherwise (`retry:`)
    this.closed = false;
    this.ctrl = null;
    this.run();
  }

  close() {
    this.closed = true;
    if (this.ctrl) this.ctrl.abort();
  }

  async run() {
    while (!this.closed) {
      let status = 0;
      try {
        this.ctrl = new AbortController();
        const headers = { Authorization: "Bearer " + token(), Accept: "text/event-stream" };
        if (this.lastId) headers["Last-Event-ID"] = this.lastId;
        const resp = await fetch(this.url, { headers, signal: this.ctrl.signal, cache: "no-store" });
        status = resp.status;
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        this.onopen();
        await this.read(resp.body.pipeThrough(new TextDecoderStream()).getReader());
      } catch (e) {
        if (this.closed) return;
        if (status >= 400 && status < 500) {
          this.onerror(true, e);
          return;
        }
      }
      if (this.closed) return;
      this.onerror(false);
      await new Promise((resolve) => setTimeout(resolve, this.retryMs));
    }
  }

  async read(reader) {
    let buf = "";
    let type = "", data = [], id = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      for (;;) {
        const m = /\r\n|\r|\n/.exec(buf);
        // A \r at the very end may be the first half of a \r\n still on its way.
        if (!m || (m[0] === "\r" && m.index === buf.length - 1)) break;
        const line = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        if (line === "") { // the end of an event
          if (id !== null) this.lastId = id;
          if (data.length) this.onevent(type || "message", data.join("\n"));
          type = "";
          data = [];
          id = null;
          continue;
        }
        if (line.startsWith(":")) continue; // a comment (the server's keep-alive)
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") type = val;
        else if (field === "data") data.push(val);
        else if (field === "id" && !val.includes("\0")) id = val;
        else if (field === "retry" && /^\d+$/.test(val)) this.retryMs = Number(val);
      }
    }
  }
}

function setConn(state, text) {
  const c = document.getElementById("conn");
  c.dataset.state = state;
  c.textContent = text;
}

// ------------------------------------------------------------------ router

const app = document.getElementById("app");
let current = null; // the view on screen: { stop() }

function route() {
  if (current) current.stop();
  current = null;
  app.replaceChildren();
  if (!token()) {
    current = new LoginView();
    return;
  }
  if (location.hash === "#/login") history.replaceState(null, "", location.pathname + location.search + "#/");
  const m = location.hash.match(/^#\/jobs\/([A-Za-z0-9_-]{1,64})/) ||
    (!location.hash || location.hash === "#" || location.hash === "#/") && location.pathname.match(/\/jobs\/([A-Za-z0-9_-]{1,64})$/);
  current = m ? new JobView(m[1]) : new JobsView();
}

window.addEventListener("hashchange", () => { scrubToken(); route(); });

// ------------------------------------------------------------------ sign in

// The sign-in view: the token is typed (or pasted) into a password field, never
// carried by a URL.  It is checked with GET api/v1/whoami before it is kept; the
// page then shows the view that was asked for (the address is left as it was).
class LoginView {
  constructor() {
    app.dataset.view = "login";
    document.title = "Pacer: sign in";
    setConn("idle", "");
    const input = el("input", { id: "login-token", type: "password", name: "token", autocomplete: "off",
      spellcheck: "false", required: true, placeholder: "API token" });
    const error = el("p", { id: "login-error", class: "error", hidden: true });
    const note = el("p", { id: "login-note", class: "note", hidden: !signInNote }, signInNote);
    signInNote = "";
    const submit = async (ev) => {
      ev.preventDefault();
      error.hidden = true;
      setToken(input.value.trim());
      try {
        const who = await api("GET", "api/v1/whoami");
        setWho(who);
        route();
      } catch (e) {
        setToken("");
        error.hidden = false;
        error.textContent = e.status === 401 ? `Not signed in: ${e.message}` : `Cannot check the token: ${e.message}`;
      }
    };
    app.append(el("h1", {}, "Sign in"),
      el("p", {}, "Paste your Pacer API token: `pacer up` writes it to the file it names, your platform team hands out " +
        "a team's. It stays in this tab only."),
      note,
      el("form", { id: "login-form", onsubmit: submit }, input, " ", el("button", { id: "login-btn", type: "submit" }, "Sign in")),
      error);
    input.focus();
  }

  stop() {}
}

// ------------------------------------------------------------------ jobs list

class JobsView {
  constructor() {
    app.dataset.view = "jobs";
    document.title = "Pacer: jobs";
    setConn("idle", "");
    this.body = el("tbody", { id: "jobs-body" });
    this.error = el("p", { id: "jobs-error", class: "error", hidden: true });
    app.append(
      el("h1", {}, "Jobs"),
      this.error,
      el("table", { id: "jobs", class: "grid" },
        el("thead", {}, el("tr", {}, ...["Name", "Model", "State", "Progress", "Started", "JCT"].map((h) => el("th", {}, h)))),
        this.body),
      this.submitForm(),
    );
    this.load();
    this.timer = setInterval(() => this.load(), 2000);
  }

  stop() { clearInterval(this.timer); }

  async load() {
    try {
      const data = await api("GET", "api/v1/jobs");
      this.error.hidden = true;
      this.render(data.jobs || []);
    } catch (e) {
      this.error.hidden = false;
      this.error.textContent = `Cannot list jobs: ${e.message}`;
    }
  }

  render(jobs) {
    const rows = jobs.map((rec) => {
      const p = jobProgress(rec);
      return el("tr", { "data-job": rec.job, "data-state": rec.state },
        el("td", { "data-field": "name" }, el("a", { href: `#/jobs/${rec.job}` }, rec.job)),
        el("td", { "data-field": "model" }, rec.spec && rec.spec.model ? rec.spec.model.name : "-"),
        el("td", { "data-field": "state" }, el("span", { class: `badge ${rec.state}` }, rec.state)),
        el("td", { "data-field": "progress", "data-value": p.toFixed(1) },
          el("div", { class: "meter" }, el("div", { style: `width:${p.toFixed(1)}%` })), ` ${p.toFixed(0)}%`),
        el("td", { "data-field": "started" }, fmtTime(rec.started_at)),
        el("td", { "data-field": "jct" }, jct(rec)));
    });
    if (!rows.length) rows.push(el("tr", { class: "empty" }, el("td", { colspan: 6 }, "No jobs yet: submit a spec below or run `pacer submit`.")));
    this.body.replaceChildren(...rows);
  }

  submitForm() {
    const text = el("textarea", { id: "submit-spec", rows: 8, spellcheck: "false",
      placeholder: "name: my-job\nmodel: wide_deep\ndataset:\n  path: data/train.tsv" });
    const result = el("pre", { id: "submit-result", class: "result" });
    const submit = async (ev) => {
      ev.preventDefault();
      result.className = "result";
      result.textContent = "Submitting...";
      try {
        const rec = await api("POST", "api/v1/jobs", JSON.stringify({ spec: text.value }));
        result.textContent = `Submitted ${rec.job}: ${rec.state}`;
        location.hash = `#/jobs/${rec.job}`;
      } catch (e) {
        result.className = "result error";
        result.textContent = e.message;
      }
    };
    return el("details", { class: "submit" }, el("summary", {}, "Submit a job (YAML or JSON spec)"),
      el("form", { onsubmit: submit }, text, el("button", { id: "submit-btn", type: "submit" }, "Submit")), result);
  }
}

// ------------------------------------------------------------------ one job

class JobView {
  constructor(job) {
    this.job = job;
    this.stateTs = -1;         // time of the state shown (record.updated_at or the JobEvent's ts)
    this.state = "";
    this.series = [];          // [{t, v}] throughput points
    this.lastStatsTs = 0;      // newest monitor statistics seen
    this.metrics = new Map();  // node -> newest AgentMetrics (fallback throughput)
    this.nodes = new Map();    // node -> merged view (executor, node events, statistics)
    this.shards = null;        // {todo, doing, done, failed, records_done, records_total, ts}
    this.datasets = new Map(); // dataset -> newest DatasetStatus
    this.timeline = [];
    this.dirty = false;
    app.dataset.view = "job";
    document.title = `Pacer: ${job}`;
    this.build();
    this.load();
    this.timer = setInterval(() => this.load(), 10000);
    this.connect();
  }

  stop() {
    clearInterval(this.timer);
    if (this.stream) this.stream.close();
  }

  build() {
    const job = this.job;
    app.append(
      el("nav", {}, el("a", { href: "#/" }, "\u2190 all jobs")),
      el("h1", {}, el("span", { id: "job-name" }, job), " ",
        el("span", { id: "job-state", class: "badge", "data-state": "" }, "...")),
      el("p", { id: "job-reason", class: "reason" }),
      el("p", { id: "job-error", class: "error", hidden: true }),
      el("section", { class: "cards" },
        this.card("Job", el("dl", { id: "job-info" })),
        this.card("Plan", el("dl", { id: "job-plan" }, el("dt", {}, "plan"), el("dd", {}, "none yet"))),
        this.card("Throughput",
          el("div", { class: "big" }, el("span", { id: "throughput", "data-value": "" }, "-"), el("small", {}, " samples/s")),
          el("div", { id: "throughput-source", class: "muted" }),
          el("div", { id: "throughput-chart", class: "chart" })),
        this.card("Shards",
          el("div", { id: "shards-bar", class: "stack" }),
          el("dl", { id: "shards", class: "inline" },
            ...["todo", "doing", "done", "failed"].flatMap((k) => [el("dt", { class: k }, k), el("dd", { id: `shards-${k}` }, "-")])),
          el("div", { id: "shards-records", class: "muted" })),
      ),
      el("section", {},
        el("h2", {}, "Nodes"),
        el("table", { id: "nodes", class: "grid" },
          el("thead", {}, el("tr", {}, ...["Node", "Role", "State", "BPT short", "BPT long", "BPT", "Samples/s", "Straggler", "Restarts", "Pod"]
            .map((h) => el("th", {}, h)))),
          el("tbody", { id: "nodes-body" }))),
      el("section", { class: "two" },
        el("div", {}, el("h2", {}, "Timeline"), el("ol", { id: "timeline", class: "timeline" })),
        el("div", {},
          el("h2", {}, "Actions"),
          el("p", {}, el("button", { id: "stop-btn", onclick: () => this.stopJob() }, "Stop job"),
            " ", el("span", { id: "stop-result", class: "muted" })),
          el("h2", {}, "Logs"),
          el("p", {}, el("select", { id: "logs-node" }), " ",
            el("select", { id: "logs-container" }, el("option", {}, "trainer"), el("option", {}, "agent")), " ",
            el("button", { id: "logs-btn", onclick: () => this.loadLogs() }, "Show")),
          el("pre", { id: "logs", class: "logs" }))),
    );
  }

  card(title, ...body) {
    return el("div", { class: "card" }, el("h2", {}, title), ...body);
  }

  // -------------------------------------------------------------- data in

  async load() {
    let data;
    try {
      data = await api("GET", `api/v1/jobs/${this.job}`);
    } catch (e) {
      const err = document.getElementById("job-error");
      err.hidden = false;
      err.textContent = e.status === 404 ? `No job named ${this.job}.` : `Cannot load the job: ${e.message}`;
      err.dataset.code = e.code || "";
      return;
    }
    document.getElementById("job-error").hidden = true;
    const rec = data.job;
    this.record = rec;
    this.setState(rec.state, rec.reason, rec.updated_at || rec.submitted_at);
    if (rec.plan) this.setPlan(rec.plan);
    const p = rec.progress || {};
    if (p.shards_total > 0) {
      this.setShards({ todo: p.shards_todo, doing: p.shards_doing, done: p.shards_done, failed: p.shards_failed,
        records_done: p.records_done, records_total: p.records_total }, rec.updated_at || 0);
    }
    if (data.nodes) {
      for (const n of data.nodes.nodes || []) {
        const phase = n.phase === "exited" ? (n.last_reason ? "dead" : "finished") : n.phase;
        this.node(n.node, { role: n.role, pod: n.pod, restarts: n.restarts });
        this.nodeState(n.node, phase, 0);
      }
      if (data.nodes.plan && !rec.plan) this.setPlan(data.nodes.plan);
    }
    if (data.statistics) this.onStatistics(data.statistics);
    this.renderInfo();
    this.schedule();
  }

  connect() {
    setConn("connecting", "connecting...");
    const known = new Set(EVENT_NAMES);
    let first = true;
    this.stream = new EventStream(`api/v1/events?job=${encodeURIComponent(this.job)}`, {
      onopen: () => {
        // The first connection replays the history; a reconnection sends Last-Event-ID and
        // gets only what it missed, so the timeline and series carry on.
        if (first) {
          this.timeline = [];
          this.series = [];
          this.lastStatsTs = 0;
          first = false;
        }
        setConn("replaying", "loading history...");
      },
      onevent: (name, data) => {
        if (!known.has(name)) return;
        let msg;
        try { msg = JSON.parse(data); } catch (e) { return; }
        this.onEvent(name, msg);
      },
      onerror: (final, e) => setConn("error", final ? `event stream: ${e.message}` : "reconnecting..."),
    });
  }

  onEvent(name, msg) {
    if (name === "replayed") {
      setConn("live", "live");
      app.dataset.replayed = String(msg.count);
      return;
    }
    const [domain, kind] = name.split(".");
    switch (domain) {
      case "job":
        if (kind === "plan") {
          this.setPlan(msg);
          this.addTimeline(msg.ts || Date.now() / 1000, name, `plan: ${msg.workers} workers, ${msg.ps} PS (${msg.source})`, msg.reason);
        } else {
          this.setState(msg.state, msg.reason, msg.ts);
          this.addTimeline(msg.ts, name, `job ${msg.state}` + (msg.previous ? ` (was ${msg.previous})` : ""), msg.reason);
        }
        break;
      case "node": {
        const state = { created: "pending", running: "running", died: "dead", finished: "finished" }[kind] || kind;
        this.node(msg.node, { role: msg.role, pod: msg.pod, restarts: msg.restarts });
        this.nodeState(msg.node, state, msg.ts);
        const bits = [msg.reason, msg.detail];
        if (kind === "died") bits.push(msg.relaunch ? "relaunching" : "no relaunch");
        if (msg.exit_code !== null && msg.exit_code !== undefined && kind !== "running") bits.push(`exit ${msg.exit_code}`);
        if (kind === "running" && msg.pending_s) bits.push(`pending ${fmtNum(msg.pending_s, 1)}s`);
        this.addTimeline(msg.ts, name, `${msg.node} ${kind}` + (msg.generation ? ` (pod ${msg.generation})` : ""),
          bits.filter(Boolean).join("; "), { node: msg.node });
        break;
      }
      case "executor": {
        if (msg.plan) this.setPlan(msg.plan);
        const bits = [msg.reason];
        if (msg.started && msg.started.length) bits.push(`started ${msg.started.join(", ")}`);
        if (msg.stopped && msg.stopped.length) bits.push(`stopped ${msg.stopped.join(", ")}`);
        if (msg.overhead_s) bits.push(`overhead ${fmtNum(msg.overhead_s, 1)}s`);
        this.addTimeline(msg.ts, name, `executor ${kind}`, bits.filter(Boolean).join("; "));
        break;
      }
      case "monitor":
        if (kind === "statistics") this.onStatistics(msg);
        break;
      case "shard":
        if (kind === "progress") this.onProgress(msg);
        else {
          const bits = [msg.dataset && `dataset ${msg.dataset}`, msg.shard >= 0 && `shard ${msg.shard}`,
            msg.node && `node ${msg.node}`, msg.epoch >= 0 && `epoch ${msg.epoch}`, msg.detail];
          this.addTimeline(msg.ts, name, `shards ${kind}`, bits.filter(Boolean).join("; "), { node: msg.node || null });
        }
        break;
      case "controller": {
        // One per statistics round: only the rounds that did (or refused, or failed) something.
        const acts = [...(msg.executed || []).map((a) => `${a.kind}${a.node ? " " + a.node : ""}`),
          ...(msg.refused || []).map((a) => `${a.kind} refused`), ...(msg.failed || []).map((a) => `${a.kind} failed`)];
        if (acts.length || msg.fallback) {
          const why = [...(msg.executed || []).map((a) => a.reason), ...(msg.refused || []).map((a) => a.reason),
            ...(msg.failed || []).map((a) => a.reason), msg.fallback && "policy did not answer: fallback", msg.reason];
          this.addTimeline(msg.ts, name, `controller (${msg.policy}): ${acts.join(", ") || "no action"}`,
            why.filter(Boolean).join("; "));
        }
        break;
      }
      case "brain": {
        const p = msg.plan || {};
        const bits = [msg.stage && `stage ${msg.stage}`,
          msg.measured_throughput > 0 && `measured ${fmtNum(msg.measured_throughput)}/s`,
          msg.predicted_throughput > 0 && `predicted ${fmtNum(msg.predicted_throughput)}/s`];
        this.addTimeline(msg.ts, name, `brain ${msg.rule}: ${p.workers} workers, ${p.ps} PS`, bits.filter(Boolean).join("; "));
        break;
      }
      case "agent":
        if (kind === "metrics") this.onMetrics(msg);
        else if (kind === "action") {
          const what = `${msg.kind} ${msg.applied ? "applied" : "not applied"}` +
            (msg.target_iteration >= 0 ? ` at iteration ${msg.target_iteration}` : "");
          const bits = [msg.nodes && msg.nodes.length && `nodes ${msg.nodes.join(", ")}`, msg.detail];
          this.addTimeline(msg.ts || Date.now() / 1000, name, what, bits.filter(Boolean).join("; "));
        }
        break;
    }
    this.schedule();
  }

  onStatistics(s) {
    if (s.ts < this.lastStatsTs) return;
    this.lastStatsTs = s.ts;
    this.addPoint(s.ts, s.throughput_samples_per_s, "monitor statistics");
    for (const n of s.nodes || []) {
      this.node(n.node, {
        role: n.role || undefined, bpt_short_s: n.bpt_short_s, bpt_long_s: n.bpt_long_s,
        speed: n.speed_samples_per_s, straggler: n.straggler, restarts: n.restarts,
      });
      this.nodeState(n.node, n.state, s.ts, true);
    }
    if (s.shards && !this.datasets.size) {
      this.setShards(s.shards, s.shards.updated || s.ts);
    }
  }

  onProgress(ev) {
    const st = ev.status || {};
    this.datasets.set(st.dataset, st);
    // The training dataset is what the job's progress means; other datasets (eval) are summed in.
    const sum = { todo: 0, doing: 0, done: 0, failed: 0, records_done: 0, records_total: 0 };
    for (const d of this.datasets.values()) {
      for (const k of Object.keys(sum)) sum[k] += d[k] || 0;
    }
    this.setShards(sum, ev.ts, true);
  }

  onMetrics(m) {
    this.metrics.set(m.node, m);
    this.node(m.node, { role: m.role });
    this.nodeState(m.node, "running", m.ts, true);
    if (this.lastStatsTs && m.ts - this.lastStatsTs < METRICS_FRESH_S) return; // the monitor speaks
    let total = 0;
    for (const x of this.metrics.values()) {
      if (x.role !== "ps" && m.ts - x.ts < METRICS_FRESH_S && !x.exiting) total += x.samples_per_s || 0;
    }
    this.node(m.node, { bpt_short_s: m.bpt_s, speed: m.samples_per_s });
    this.addPoint(m.ts, total, "agent metrics");
  }

  // -------------------------------------------------------------- state

  setState(state, reason, ts) {
    if (!state || ts < this.stateTs) return;
    // The record and the JobEvent of one transition carry the same time: keep the reason either gave.
    if (ts === this.stateTs && state === this.state && !reason) return;
    this.stateTs = ts;
    this.state = state;
    const badge = document.getElementById("job-state");
    badge.textContent = state;
    badge.dataset.state = state;
    badge.className = `badge ${state}`;
    setText("job-reason", reason || "");
    document.getElementById("stop-btn").disabled = TERMINAL.has(state);
  }

  setPlan(plan) {
    this.plan = plan;
    const dl = document.getElementById("job-plan");
    dl.dataset.workers = plan.workers;
    dl.dataset.ps = plan.ps;
    dl.replaceChildren(...dlItems([
      ["workers", `${plan.workers} \u00d7 ${fmtNum(plan.worker_cpu, 1)} CPU, ${plan.worker_memory_mb} MiB`],
      ["PS", `${plan.ps} \u00d7 ${fmtNum(plan.ps_cpu, 1)} CPU, ${plan.ps_memory_mb} MiB`],
      ["source", plan.source],
      ["why", plan.reason || "-"],
    ]));
  }

  setShards(s, ts, authoritative) {
    if (this.shards && !authoritative && ts < this.shards.ts) return;
    this.shards = { ...s, ts };
  }

  node(name, fields) {
    let n = this.nodes.get(name);
    if (!n) {
      n = { node: name, role: "", state: "", stateTs: -1, restarts: 0 };
      this.nodes.set(name, n);
    }
    for (const [k, v] of Object.entries(fields)) if (v !== undefined && v !== "") n[k] = v;
    return n;
  }

  // A node's state comes from whoever saw it last; the monitor's guess never
  // overrides the executor's "finished" (a finished node falls silent).
  nodeState(name, state, ts, fromMonitor) {
    const n = this.node(name, {});
    if (ts < n.stateTs) return;
    if (fromMonitor && n.state === "finished") return;
    n.state = state;
    n.stateTs = ts;
  }

  addPoint(t, v, source) {
    if (v === null || v === undefined) return;
    const last = this.series[this.series.length - 1];
    if (last && t < last.t) return;
    this.series.push({ t, v });
    if (this.series.length > SERIES_MAX) this.series.shift();
    this.throughputSource = source;
  }

  addTimeline(ts, kind, text, detail, extra) {
    this.timeline.push({ ts: ts || 0, kind, text, detail: detail || "", ...(extra || {}) });
    if (this.timeline.length > TIMELINE_MAX) this.timeline.shift();
  }

  // -------------------------------------------------------------- render (batched)

  schedule() {
    if (this.dirty) return;
    this.dirty = true;
    setTimeout(() => { this.dirty = false; this.render(); }, 50);
  }

  render() {
    this.renderThroughput();
    this.renderNodes();
    this.renderShards();
    this.renderTimeline();
    this.renderInfo();
  }

  renderInfo() {
    const rec = this.record;
    if (!rec) return;
    const spec = rec.spec || {};
    const items = [
      ["model", spec.model ? spec.model.name : "-"],
      ["mode", `${spec.mode || "-"}, batch ${spec.batch_size || "-"}, ${spec.epochs || "-"} epoch(s)`],
      ["dataset", spec.dataset ? spec.dataset.path : "-"],
      ["submitted", fmtTime(rec.submitted_at)],
      ["started", fmtTime(rec.started_at)],
      ["finished", fmtTime(rec.finished_at)],
      ["JCT", jct(rec)],
      ["progress", `${this.progress().toFixed(0)}%`],
      ["restarts", rec.node_restarts],
    ];
    for (const [k, v] of Object.entries(rec.result || {})) items.push([k, typeof v === "number" ? fmtNum(v, 4) : JSON.stringify(v)]);
    document.getElementById("job-info").replaceChildren(...dlItems(items));
  }

  // Live shard counts when the page has them; the record's (refreshed every 10 s) otherwise.
  progress() {
    const s = this.shards;
    if (s && s.records_total > 0 && !TERMINAL.has(this.state)) return pct(s.records_done, s.records_total);
    return jobProgress(this.record);
  }

  renderThroughput() {
    const last = this.series[this.series.length - 1];
    const out = document.getElementById("throughput");
    if (last) {
      out.textContent = fmtNum(last.v);
      out.dataset.value = String(last.v);
      setText("throughput-source", `from ${this.throughputSource}, ${fmtTime(last.t)}`);
    }
    const box = document.getElementById("throughput-chart");
    const W = 320, H = 100, pad = 2;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img",
      "aria-label": "throughput over time" });
    if (this.series.length >= 1) {
      const t0 = this.series[0].t, t1 = Math.max(last.t, t0 + 1e-9);
      const vmax = Math.max(...this.series.map((p) => p.v), 1e-9) * 1.1;
      const pts = this.series.map((p) => {
        const x = this.series.length === 1 ? W / 2 : pad + ((p.t - t0) / (t1 - t0)) * (W - 2 * pad);
        const y = H - pad - (p.v / vmax) * (H - 2 * pad);
        return `${x.toFixed(1)},${y.toFixed(1)}`;
      });
      svg.append(svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: "currentColor", "stroke-width": 1.5,
        "vector-effect": "non-scaling-stroke" }));
      const label = svgEl("text", { x: 4, y: 12, "font-size": 10, fill: "currentColor" });
      label.textContent = `max ${fmtNum(vmax / 1.1)}`;
      svg.append(label);
    }
    svg.dataset.points = String(this.series.length);
    box.replaceChildren(svg);
  }

  renderNodes() {
    const nodes = [...this.nodes.values()].sort((a, b) => nodeOrder(a.node) - nodeOrder(b.node) || a.node.localeCompare(b.node));
    const maxBpt = Math.max(0, ...nodes.map((n) => n.bpt_short_s || 0));
    const rows = nodes.map((n) => {
      const w = maxBpt > 0 ? pct(n.bpt_short_s || 0, maxBpt) : 0;
      return el("tr", { "data-node": n.node, "data-state": n.state, class: n.straggler ? "straggler" : "" },
        el("td", { "data-field": "node" }, n.node),
        el("td", { "data-field": "role" }, n.role || "-"),
        el("td", { "data-field": "state" }, el("span", { class: `badge ${n.state}` }, n.state || "-")),
        el("td", { "data-field": "bpt_short", "data-value": n.bpt_short_s ?? "" }, n.bpt_short_s ? `${fmtNum(n.bpt_short_s * 1000, 1)} ms` : "-"),
        el("td", { "data-field": "bpt_long", "data-value": n.bpt_long_s ?? "" }, n.bpt_long_s ? `${fmtNum(n.bpt_long_s * 1000, 1)} ms` : "-"),
        el("td", { "data-field": "bpt_bar" }, el("div", { class: "bar" }, el("div", { style: `width:${w.toFixed(1)}%` }))),
        el("td", { "data-field": "speed", "data-value": n.speed ?? "" }, n.speed !== undefined ? fmtNum(n.speed) : "-"),
        el("td", { "data-field": "straggler" }, n.straggler || ""),
        el("td", { "data-field": "restarts" }, n.restarts || 0),
        el("td", { "data-field": "pod", class: "muted" }, n.pod || ""));
    });
    document.getElementById("nodes-body").replaceChildren(...rows);
    const select = document.getElementById("logs-node");
    if (select.options.length !== nodes.length) {
      const keep = select.value;
      select.replaceChildren(...nodes.map((n) => el("option", { value: n.node }, n.node)));
      if (keep) select.value = keep;
    }
  }

  renderShards() {
    const s = this.shards;
    if (!s) return;
    const total = s.todo + s.doing + s.done + s.failed;
    for (const k of ["todo", "doing", "done", "failed"]) {
      const node = setText(`shards-${k}`, String(s[k]));
      node.dataset.value = String(s[k]);
    }
    document.getElementById("shards-bar").replaceChildren(...["done", "doing", "todo", "failed"].map((k) =>
      el("div", { class: k, style: `width:${pct(s[k], total).toFixed(2)}%`, title: `${k}: ${s[k]}` })));
    setText("shards-records", s.records_total ? `${fmtNum(s.records_done, 0)} / ${fmtNum(s.records_total, 0)} records (${pct(s.records_done, s.records_total).toFixed(1)}%)` : "");
  }

  renderTimeline() {
    const items = [...this.timeline].sort((a, b) => b.ts - a.ts).map((e) =>
      el("li", { "data-kind": e.kind, "data-node": e.node || null, class: e.kind.replace(".", "-") },
        el("time", {}, fmtTime(e.ts)), " ", el("b", {}, e.text), e.detail ? el("span", { class: "detail" }, ` ${e.detail}`) : null));
    document.getElementById("timeline").replaceChildren(...items);
  }

  // -------------------------------------------------------------- actions

  async stopJob() {
    if (!confirm(`Stop job ${this.job}?`)) return;
    try {
      const rec = await api("POST", `api/v1/jobs/${this.job}/stop`, JSON.stringify({ reason: "stopped from the dashboard" }));
      setText("stop-result", `now ${rec.state}`);
      this.load();
    } catch (e) {
      setText("stop-result", e.message);
    }
  }

  async loadLogs() {
    const node = document.getElementById("logs-node").value;
    const container = document.getElementById("logs-container").value;
    const out = document.getElementById("logs");
    if (!node) { out.textContent = "No node yet."; return; }
    out.textContent = "Loading...";
    try {
      const r = await api("GET", `api/v1/jobs/${this.job}/logs?node=${encodeURIComponent(node)}&tail=200&container=${container}`);
      out.textContent = r.text || "(empty)";
    } catch (e) {
      out.textContent = e.message;
    }
  }
}

function dlItems(pairs) {
  return pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { "data-field": k }, v === undefined || v === null || v === "" ? "-" : String(v))]);
}

function nodeOrder(name) {
  return name.startsWith("ps-") ? 0 : name.startsWith("chief") ? 1 : 2;
}

scrubToken();
if (token()) api("GET", "api/v1/whoami").then(setWho, () => {}); // a reload keeps the tab's sign-in
route();
