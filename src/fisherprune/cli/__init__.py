"""Command line: one module per subcommand, each with ``<cmd>_parser`` and ``<cmd>_command``."""
