"""The devices wing: which device to use and why not, host facts, doctor, canaries, parity."""
