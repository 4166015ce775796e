"""One module per ``memfit`` subcommand; :mod:`memfit.cli` lists them."""
