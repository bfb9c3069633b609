"""Preference pairs for DPO: read from JSONL (ftis, HH-RLHF and SHP layouts) or made from the
embedded benchmark (a verified-correct and a verified-wrong response per prompt). docs/dpo.md."""

from ftis.preferences.data import (
    FORMATS,
    PreferenceDataError,
    PreferencePair,
    fixture_path,
    from_hh_rlhf,
    from_shp,
    pair_from_row,
    read_pairs,
    render_plain,
)

__all__ = [
    "FORMATS",
    "PreferenceDataError",
    "PreferencePair",
    "fixture_path",
    "from_hh_rlhf",
    "from_shp",
    "pair_from_row",
    "read_pairs",
    "render_plain",
]
