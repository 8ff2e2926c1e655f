"""Issue: slot and publication names were derived from the source name with
``-`` as ``_`` and lower-cased, so sources ``a-b`` and ``a_b`` (or two
pipelines with a source ``shop``) shared one slot and skipped each other's
changes. Names now carry the pipeline's identity, and a digest of the source
name wherever folding changed it."""

from __future__ import annotations

import re

from reclock.sources.postgres.source import default_name


def test_names_that_fold_alike_stay_apart() -> None:
    names = [default_name(s, "p1") for s in ("a-b", "a_b", "Shop", "shop", "SHOP")]
    assert len(set(names)) == len(names), names
    assert default_name("shop", "p1") != default_name("shop", "p2")  # two pipelines


def test_names_are_valid_postgres_identifiers_of_63_characters_at_most() -> None:
    long = ["x" * 63, "x" * 62 + "y", "A-" + "z" * 61]
    names = [default_name(s, "0123456789abcdef") for s in long]
    assert len(set(names)) == len(names)
    assert all(len(n) <= 63 and re.fullmatch(r"[a-z0-9_]+", n) for n in names), names


def test_the_name_from_before_pipeline_identities_is_kept_for_adoption() -> None:
    assert default_name("shop", None) == "reclock_shop"
