"""The doors on the host: one module per door (egress so far), and the sans-IO checks they share."""
