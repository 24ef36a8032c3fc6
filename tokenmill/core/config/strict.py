"""What every config section is: unknown keys fail with their dotted path instead of being
ignored, and assignments are validated like construction."""

from pydantic import ConfigDict

STRICT = ConfigDict(extra="forbid", validate_assignment=True)
