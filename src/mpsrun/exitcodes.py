"""The exit codes users and schedulers see, in one place for every wing.

0 done, 1 failure while running (non-finite loss included), 2 bad input (recipe,
override, CLI, unusable device, missing data, unreachable server), 130 interrupted
(SIGINT), 143 terminated (SIGTERM). The CLI sets them; the launcher and the signal
handling in the training wing compute them, so they cannot live in the CLI.
"""

EXIT_OK, EXIT_FAIL, EXIT_INPUT, EXIT_INTERRUPT, EXIT_TERM = 0, 1, 2, 130, 143
