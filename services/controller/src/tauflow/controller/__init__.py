"""tauflow controller: owns a run — its config, the launch of the services, their health, the summary."""

__version__ = "0.1.0"
