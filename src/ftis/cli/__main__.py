"""`python -m ftis.cli`: the `ftis` command."""

from ftis.cli import main

main()
