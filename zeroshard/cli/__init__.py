"""The `zeroshard` command: `launch`, `estimate`, `report`, `check-config` (see docs/cli.md).

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser and sets
`func` (the handler, `(args) -> int`) as the parser's default; `main.py` only assembles them.
"""
