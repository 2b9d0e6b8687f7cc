"""The ``pacer`` command line (installed as ``pacer_services.cli``; console script ``pacer``).

It composes the other parts rather than being imported by them, which is why
it is not in ``libs``: ``pacer up`` and ``pacer demo`` start the embedded
stack (:mod:`.stack`: nats-server plus every service as a process),
``pacer sim`` runs the simulators that drive the services' cores, and the
job and data commands (:mod:`.jobs`, :mod:`.data`) are thin clients of the
bus.  ``libs/pacer`` keeps what several processes import and never imports
this package.

    main.py   the argument parser and the small commands (up, status, train local, schemas, sim)
    stack.py  the embedded stack: nats-server + the services as local processes
    demo.py   ``pacer demo``: a whole Wide&Deep job on the embedded stack
    jobs.py   ``pacer submit | jobs | job | logs | stop``
    data.py   ``pacer data gen | convert``
    progress.py  the progress bar of long waits (submit --wait, demo)
"""
