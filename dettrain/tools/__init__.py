"""Command-line tools: each module has a ``main(argv)``; ``dettrain <command>`` and
``python -m dettrain.<command>`` run them."""
