"""`python -m deployer` is `sits-deployer`."""

from deployer.cli.main import main

main()
