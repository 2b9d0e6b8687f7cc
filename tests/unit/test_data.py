"""Criteo data: the readers accept both real layouts (missing values included), the
record file round-trips and refuses bad files, the generator is deterministic
and carries a learnable planted signal, and the ``pacer data`` CLI works."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from pacer.data import criteo
from pacer.data.criteo import RECORD_DTYPE, BadRecordFile, MalformedLine, RecordFile
from pacer.models.metrics import auc


def _shared_data() -> Path:
    env = os.environ.get("PACER_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


SHARED = _shared_data()
TSV = SHARED / "criteo_sample.tsv"
CSV = SHARED / "criteo_sample.csv"
needs_samples = pytest.mark.skipif(
    not (TSV.exists() and CSV.exists()),
    reason=f"the real Criteo samples are not at {SHARED} (set PACER_SHARED_DATA to their directory)",
)


def same_records(a: np.ndarray, b: np.ndarray) -> bool:
    # Byte equality: NaN != NaN as floats, but both readers write the same NaN.
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------- real files


@needs_samples
def test_real_tsv_and_csv_parse_to_identical_records_with_missing_values() -> None:
    assert criteo.detect_layout(TSV).name == "tsv" and not criteo.detect_layout(TSV).has_header
    assert criteo.detect_layout(CSV).name == "csv" and criteo.detect_layout(CSV).has_header
    tsv = criteo.read_criteo(TSV)
    csv = criteo.read_criteo(CSV)
    assert len(tsv) == len(csv) == 200
    np.testing.assert_array_equal(tsv["label"], csv["label"])
    assert set(np.unique(tsv["label"])) == {0.0, 1.0}

    nan_t, nan_c = np.isnan(tsv["dense"]), np.isnan(csv["dense"])
    assert nan_t.any(), "the sample has missing integers; the reader must keep them as NaN"
    np.testing.assert_array_equal(nan_t, nan_c)
    np.testing.assert_array_equal(tsv["dense"][~nan_t], csv["dense"][~nan_c])  # "260.0" == "260"
    assert (tsv["dense"] == -1).any(), "the real -1 values survive"

    assert (tsv["cat"] == 0).any(), "the sample has missing categoricals; they must read as 0"
    np.testing.assert_array_equal(tsv["cat"], csv["cat"])
    assert same_records(tsv, csv)

    # Row 1 by hand: 0,,3,260.0,,17668.0,...,05db9164,08d6d899,...,C19 empty
    assert tsv["label"][0] == 0
    assert np.isnan(tsv["dense"][0, 0]) and tsv["dense"][0, 1] == 3 and tsv["dense"][0, 2] == 260
    assert tsv["dense"][0, 4] == 17668
    assert tsv["cat"][0, 0] == 0x05DB9164 and tsv["cat"][0, 1] == 0x08D6D899
    assert tsv["cat"][0, 18] == 0 and tsv["cat"][0, 19] == 0


@needs_samples
def test_convert_to_record_file_and_read_any_range(tmp_path: Path) -> None:
    parsed = criteo.read_criteo(TSV)
    for src in (TSV, CSV):
        dst = tmp_path / f"{src.suffix[1:]}.rec"
        assert criteo.convert(src, dst) == 200
        assert dst.stat().st_size == criteo.HEADER_SIZE + 200 * RECORD_DTYPE.itemsize
        with RecordFile.open(dst) as rf:
            assert len(rf) == 200
            assert same_records(rf.read(0, 200), parsed)
            assert same_records(rf.read(57, 131), parsed[57:131])
            assert same_records(rf.read(199, 200), parsed[199:])
            assert len(rf.read(80, 80)) == 0
            with pytest.raises(IndexError):
                rf.read(150, 201)
            with pytest.raises(IndexError):
                rf.read(-1, 3)


@needs_samples
def test_chunked_and_gzipped_reading_gives_the_same_records(tmp_path: Path) -> None:
    whole = criteo.read_criteo(TSV)
    chunks = list(criteo.iter_criteo(CSV, chunk_rows=64))
    assert [len(c) for c in chunks] == [64, 64, 64, 8]
    assert same_records(np.concatenate(chunks), whole)
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(TSV.read_bytes()))
    assert same_records(criteo.read_criteo(gz), whole)


# ---------------------------------------------------------- malformed input

GOOD = "1\t" + "\t".join(["5"] * 13) + "\t" + "\t".join(["68fd1e64"] * 26)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("1\t2\t3", "3 fields, expected 40"),
        (GOOD.replace("\t5\t", "\tfive\t", 1), "I1 is not a number"),
        ("2" + GOOD[1:], "bad label"),
        ("\t" + GOOD[2:], "bad label"),
        (GOOD + "\textra", "41 fields"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    f = tmp_path / "day.tsv"
    f.write_text(f"{GOOD}\n{GOOD}\n{bad}\n{GOOD}\n")
    with pytest.raises(MalformedLine) as ei:
        criteo.read_criteo(f)
    assert ei.value.line == 3
    assert f"{f}:3:" in str(ei.value) and reason in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_malformed_csv_line_number_counts_the_header(tmp_path: Path) -> None:
    good = GOOD.replace("\t", ",")
    f = tmp_path / "x.csv"
    f.write_text(",".join(criteo.CSV_HEADER) + f"\n{good}\n{good},zz\n")
    with pytest.raises(MalformedLine, match=r"x\.csv:3: .*41 fields"):
        criteo.read_criteo(f)


def test_categorical_ids() -> None:
    assert criteo.cat_id("") == 0
    assert criteo.cat_id("05db9164") == 0x05DB9164
    assert criteo.cat_id("00000000") == 1  # present never looks missing
    assert criteo.cat_id("1ffffffff") == 0xFFFFFFFF  # wider hex is cut to 32 bits
    v = criteo.cat_id("not-hex")
    assert v not in (0, 1) and v == criteo.cat_id("not-hex") < 2**32


# --------------------------------------------------------------- record file


def test_record_file_rejects_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "good.rec"
    records = np.zeros(10, dtype=RECORD_DTYPE)
    records["label"] = np.arange(10) % 2
    assert RecordFile.write(good, [records[:4], records[4:]]) == 10
    raw = good.read_bytes()

    wrong_magic = tmp_path / "magic.rec"
    wrong_magic.write_bytes(b"NOTPACER" + raw[8:])
    with pytest.raises(BadRecordFile, match="magic"):
        RecordFile.open(wrong_magic)
    truncated = tmp_path / "cut.rec"
    truncated.write_bytes(raw[:-7])
    with pytest.raises(BadRecordFile, match="truncated"):
        RecordFile.open(truncated)
    tiny = tmp_path / "tiny.rec"
    tiny.write_bytes(raw[:20])
    with pytest.raises(BadRecordFile, match="header"):
        RecordFile.open(tiny)
    assert issubclass(BadRecordFile, ValueError)

    empty = tmp_path / "empty.rec"
    assert RecordFile.write(empty, []) == 0
    with RecordFile.open(empty) as rf:
        assert len(rf) == 0 and len(rf.read(0, 0)) == 0


def test_record_file_write_is_atomic(tmp_path: Path) -> None:
    dst = tmp_path / "x.rec"
    RecordFile.write(dst, [np.zeros(3, dtype=RECORD_DTYPE)])

    def failing() -> object:
        yield np.ones(5, dtype=RECORD_DTYPE)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        RecordFile.write(dst, failing())  # type: ignore[arg-type]
    with RecordFile.open(dst) as rf:
        assert len(rf) == 3  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["x.rec"]  # no temp file left


# ----------------------------------------------------------------- generator


def test_generate_is_deterministic_per_seed(tmp_path: Path) -> None:
    a, b, c, t = (tmp_path / n for n in ("a.rec", "b.rec", "c.rec", "t.rec"))
    assert criteo.generate(a, 3000, seed=7) == 3000
    criteo.generate(b, 3000, seed=7)
    criteo.generate(c, 3000, seed=8)
    criteo.generate(t, 3000, seed=7, stream=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.read_bytes()[criteo.HEADER_SIZE:] != t.read_bytes()[criteo.HEADER_SIZE:]
    with RecordFile.open(a) as rf:
        head = rf.read(0, 1000)
    small = tmp_path / "small.rec"
    criteo.generate(small, 1000, seed=7)
    with RecordFile.open(small) as rf:
        assert same_records(rf.read(0, 1000), head)  # a file's prefix does not depend on its length


def test_generated_data_looks_like_criteo() -> None:
    gen = criteo.CriteoLikeGenerator(3)
    rec, probs = gen.block(0, 0)
    assert 0.22 < rec["label"].mean() < 0.28  # base CTR ~0.25
    assert abs(probs.mean() - 0.25) < 0.02
    dense = rec["dense"]
    missing = np.isnan(dense).mean(axis=0)
    assert missing[11] > 0.6 and missing[1] == 0  # I12 mostly missing, I2 never
    present = dense[~np.isnan(dense)]
    assert (present == np.floor(present)).all() and (present >= -1).all()  # counts, -1 allowed
    col = dense[:, 4][~np.isnan(dense[:, 4])]
    assert col.mean() > 2 * np.median(col)  # right-skewed like Criteo's I5
    cat = rec["cat"]
    assert (cat == 0).any(axis=0).sum() >= 5  # several fields have missing values
    distinct = [len(np.unique(cat[:, f])) for f in range(criteo.NUM_CAT)]
    assert min(distinct) <= 5 and max(distinct) > 10_000  # small and large vocabularies
    top = np.unique(cat[:, 0], return_counts=True)[1].max() / len(cat)
    assert top > 0.05  # Zipf head


def test_planted_signal_is_learnable_from_counts() -> None:
    """Per-value click rates learnt on one stream rank the held-out stream well above chance."""
    gen = criteo.CriteoLikeGenerator(5)
    train = np.concatenate([gen.block(0, i)[0] for i in range(2)])
    test, true_p = gen.block(1, 0, 30_000)
    base = train["label"].mean()

    def logit(p: np.ndarray | float) -> np.ndarray:
        return np.log(np.divide(p, np.subtract(1, p)))

    score = np.zeros(len(test))
    for f in range(criteo.NUM_CAT):
        vals, inv = np.unique(train["cat"][:, f], return_inverse=True)
        clicks = np.bincount(inv, weights=train["label"], minlength=len(vals))
        shows = np.bincount(inv, minlength=len(vals))
        rate = (clicks + 20 * base) / (shows + 20)  # smoothed toward the base rate
        pos = np.searchsorted(vals, test["cat"][:, f]).clip(0, len(vals) - 1)
        known = vals[pos] == test["cat"][:, f]
        score += np.where(known, logit(rate[pos]) - logit(base), 0.0)
    learnt = auc(test["label"], score)
    oracle = auc(test["label"], true_p)
    assert 0.65 < learnt < oracle < 0.92
    shuffled = np.random.default_rng(0).permutation(test["label"])
    assert abs(auc(shuffled, score) - 0.5) < 0.03  # no signal without the labels


# ----------------------------------------------------------------- features


def test_features_and_shuffle() -> None:
    rec = np.zeros(4, dtype=RECORD_DTYPE)
    rec["label"] = [0, 1, 0, 1]
    rec["dense"][:, 0] = [np.nan, -1, 0, np.e - 1]
    rec["cat"][:, 0] = [0, 5, 1_000_005, 2**32 - 1]
    dense, cat_ids, labels = criteo.features(rec, 1000)
    assert dense.dtype == np.float32 and dense.shape == (4, 13)
    np.testing.assert_allclose(dense[:, 0], [0, 0, 0, 1], atol=1e-6)
    assert cat_ids.dtype == np.int64 and cat_ids.shape == (4, 26)
    assert list(cat_ids[:, 0]) == [0, 5, 5, (2**32 - 1) % 1000]
    assert labels.dtype == np.float32 and list(labels) == [0, 1, 0, 1]

    recs = criteo.CriteoLikeGenerator(1).block(0, 0, 500)[0]
    a, b = criteo.shuffle_within(recs, 11), criteo.shuffle_within(recs, 11)
    assert same_records(a, b) and not same_records(a, recs)
    assert not same_records(a, criteo.shuffle_within(recs, 12))
    assert sorted(a.tobytes()[i : i + 160] for i in range(0, len(a) * 160, 160)) == sorted(
        recs.tobytes()[i : i + 160] for i in range(0, len(recs) * 160, 160)
    )


# ----------------------------------------------------------------------- CLI


def test_cli_gen_and_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pacer_services.cli.main import main

    out = tmp_path / "train.rec"
    assert main(["data", "gen", "--rows", "700", "--seed", "2", "--test-rows", "300", str(out)]) == 0
    with RecordFile.open(out) as rf, RecordFile.open(criteo.heldout_path(out)) as test:
        assert len(rf) == 700 and len(test) == 300
        assert not same_records(rf.read(0, 300), test.read(0, 300))
    assert '"records": 700' in capsys.readouterr().out
    if TSV.exists():
        dst = tmp_path / "sample.rec"
        assert main(["data", "convert", str(TSV), str(dst)]) == 0
        with RecordFile.open(dst) as rf:
            assert len(rf) == 200
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n")
    assert main(["data", "convert", str(bad), str(tmp_path / "bad.rec")]) == 2
    assert "bad.tsv:1:" in capsys.readouterr().err
