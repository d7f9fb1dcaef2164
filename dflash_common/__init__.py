"""What every dflash package shares: typed errors, progress, fault points for crash tests, the
device rule, value checks and durable local writes. Imports nothing of dflash."""
