"""Configuration: one TOML file, overridden by LEASEWORK_* environment variables, overridden by
flags. Read and validated once, then passed explicitly; there are no global settings and no
registry of sections.

Every default equals the seed's figure. Unknown keys, wrong types and impossible values are
refused at start-up with the key's name and where it came from.

One module per job: `fields` (a setting's doc and range), `settings` (the engine's `Config`),
`sections` (the settings stages and families declare), `convert` (one raw value as its type),
`pools` (the pools grammar), `loader` (file, environment, flags), `reference` (the Markdown
reference), `timing` (a lease's timings, from the settings). Every name is importable from
`leasework.config` as well.
"""

from __future__ import annotations

from .convert import check_range, coerce, convert
from .fields import (
    DAY,
    ENV_PREFIX,
    RETENTION,
    SECONDS,
    Range,
    did_you_mean,
    doc,
    env_number,
    is_section,
    short,
)
from .loader import CONFIG_MAX_BYTES, load, misspelt, read_file, validate, value
from .pools import parse_pools
from .reference import reference, toml_string, toml_value
from .sections import all_keys, catalogue, field_of, forget, section, title
from .settings import EVERY_OTHER, FIELDS, POOL_KEYS, Config, Pool, S, section_fields
from .timing import LeaseTiming, lease_timing

__all__ = [
    "CONFIG_MAX_BYTES",
    "DAY",
    "ENV_PREFIX",
    "EVERY_OTHER",
    "FIELDS",
    "POOL_KEYS",
    "RETENTION",
    "SECONDS",
    "Config",
    "LeaseTiming",
    "Pool",
    "Range",
    "S",
    "all_keys",
    "catalogue",
    "check_range",
    "coerce",
    "convert",
    "did_you_mean",
    "doc",
    "env_number",
    "field_of",
    "forget",
    "is_section",
    "lease_timing",
    "load",
    "misspelt",
    "parse_pools",
    "read_file",
    "reference",
    "section",
    "section_fields",
    "short",
    "title",
    "toml_string",
    "toml_value",
    "validate",
    "value",
]
