"""What a worker does when something goes wrong: a hang watchdog, SIGTERM pre-emption, and the
per-step agreement that lets every rank stop (or save) at the same step."""
