"""The KV tiers' runner side: host slots, disk files and the link to a peer, moved as a step
asks."""
