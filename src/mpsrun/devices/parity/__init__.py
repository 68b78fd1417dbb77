"""`mpsrun parity`: tolerance (how differences are judged), replica (one device's copy),
report (what is recorded) and run (the command), in that order of imports."""
