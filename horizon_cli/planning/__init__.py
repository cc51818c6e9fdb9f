"""Planning before anything is loaded: the memory plan (host and device bytes by category) of each
rung of the ladder, and whether it fits the machine."""
