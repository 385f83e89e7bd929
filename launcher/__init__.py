"""`splitserve up`: a whole deployment as local processes."""
