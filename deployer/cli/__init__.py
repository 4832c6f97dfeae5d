"""The `sits-deployer` command line: thin click commands, one module per command group."""
