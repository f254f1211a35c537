"""The configuration error every probe check raises, in a module of its own so that both ``probes.config`` and the
modules it calls for policy checks (``probes.policy_specs``) can import it without importing each other."""

from __future__ import annotations

__all__ = ["ConfigError", "flag_of"]


class ConfigError(ValueError):
    """A configuration value is out of range; ``field`` names it (``--field-name`` on the command line)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{flag_of(field_name)}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # so a worker process's refusal reaches the driver as itself, not as a broken pool
        return type(self), (self.field, self.message)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")
