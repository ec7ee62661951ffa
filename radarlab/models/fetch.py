"""`python -m radarlab.models.fetch`: convert the offline course model once and print its directory."""
from __future__ import annotations

import sys

from radarlab.models.loader import ModelNotAvailable, course_model_dir


def main() -> int:
    try:
        print(course_model_dir())
    except ModelNotAvailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
