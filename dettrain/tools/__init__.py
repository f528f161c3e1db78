"""Command-line tools, each a module with a ``main(argv)`` that returns the exit status.

    diff.py     compare two runs step by step                      dettrain diff     python -m dettrain.diff
    trace.py    replay a step: which module and op diverged        dettrain trace    python -m dettrain.trace
    verify.py   what varies on this device; does the tier stop it  dettrain verify   python -m dettrain.verify
    advise.py   four questions -> a determinism tier               dettrain advise   python -m dettrain.advise
    audit.py    this environment's settings against a tier         dettrain audit    python -m dettrain.audit
    export.py   checkpoint -> Hugging Face directory               dettrain export   python -m dettrain.export
    memory.py   per-rank peak memory of an N-rank FSDP2 run        dettrain memory   python -m dettrain.memory
    prepare.py  text files -> a token file for data.path           dettrain prepare  python -m dettrain.data prepare

Tools depend on the library, never the reverse: no library module imports ``dettrain.tools``; only the entry points
do (cli.py, and the thin modules at the published ``python -m dettrain.<tool>`` paths that run these).
"""
