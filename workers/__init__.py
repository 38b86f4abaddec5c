"""The worker process: controller (control frames), stage executor (compute thread), data plane."""
