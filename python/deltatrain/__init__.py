"""deltatrain: Gated DeltaNet training runtime for colocated RL."""
