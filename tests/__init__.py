"""breakgraph test suite (a package so modules share ``tests.helpers``)."""
