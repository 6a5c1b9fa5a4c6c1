"""The subcommands of ``scaletrain``: one module per command.

Each module defines ``register(subparsers)``, which adds its parser (and its actions, if any) and sets
``func=callable(args) -> int`` as the parser default. The library work lives outside this package; a
command module holds flags, argument checks and printing. ``scaletrain.cli`` lists the modules in the
order ``--help`` shows them, so a new command is a new module here plus one entry in that list.
"""
