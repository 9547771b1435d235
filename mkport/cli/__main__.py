"""`python -m mkport.cli`: the same as the `mkport` command."""

from . import main

main()
