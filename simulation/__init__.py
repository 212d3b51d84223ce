"""One-machine fleets: the inline Grid, the virtual clock and the simulation runner."""
