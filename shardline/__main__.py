"""`python -m shardline`: the same as the `shardline` command."""

from shardline.app.cli import main

main()
