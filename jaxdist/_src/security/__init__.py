"""Security: mutual TLS identities, the local PKI that issues them, and the cluster's credentials
(the token, the coordinator token and the keys derived from it)."""
