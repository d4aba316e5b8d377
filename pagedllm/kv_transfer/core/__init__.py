"""The KV tiers' scheduler side: what each tier holds and the moves a step asks for."""
