"""``schemas.policy.family_slug``: a model family named as Hugging Face names models (``org/name``) becomes one
safe name wherever something is named after the family (a checkpoint file or folder, ...); the family itself
never changes."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.policy import SLUG_MAX, TINY_FAMILY, PolicyRef, family_slug

ROOT = Path(__file__).resolve().parents[1]
# what every consumer of a slug accepts: a file name, a Kafka topic / group / transactional id ([a-zA-Z0-9._-],
# at most 249), a URL path segment and an HTML id, none of them hidden or read as an option
SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

HF = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "HuggingFaceTB--SmolLM2-135M-Instruct",
    "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT": "PrimeIntellect--Qwen3-0.6B-Reverse-Text-SFT",
    "org/tiny-byte-lm": "org--tiny-byte-lm",
    "Qwen/Qwen3-0.6B": "Qwen--Qwen3-0.6B",
    "a/b/c": "a--b--c",
}
ODD = ["a--b", "a/b", "a-/b", "a/-b", "a--/b", "a/--b", "a b", "a-b", "a_b", "a:b", "a;b", "a..b", "a.b", "..",
       ".", "/", "//", "a/", "/a", "a//b", ".hidden", "-opt", "org/name@v1", "org/name v1", "ünï/cödé", "a/b\n",
       "x" * 300, "x" * 301, "y" * SLUG_MAX, "y" * (SLUG_MAX + 1), "../../etc/passwd", "org\\name", "org%2Fname"]


@pytest.mark.parametrize("family", [TINY_FAMILY, "tiny", "toy", "SmolLM2-135M-Instruct", "Qwen3-0.6B", "a_b"])
def test_a_family_that_is_already_a_safe_name_is_its_own_slug(family):
    assert family_slug(family) == family  # existing checkpoints keep their names


@pytest.mark.parametrize("family,slug", HF.items())
def test_org_slash_name_reads_as_huggingface_caches_name_it(family, slug):
    assert family_slug(family) == slug
    assert PolicyRef(family=family, revision=0).family == family  # the family itself is untouched


@pytest.mark.parametrize("family", [*HF, *ODD])
def test_every_slug_is_safe_bounded_and_never_a_path(family):
    slug = family_slug(family)
    assert SAFE.fullmatch(slug), slug
    assert len(slug) <= SLUG_MAX
    assert "/" not in slug and slug not in (".", "..")
    assert Path(slug).name == slug and len(Path(slug).parts) == 1


def test_distinct_families_get_distinct_slugs():
    families = [*HF, *ODD, TINY_FAMILY, "tiny", "SmolLM2-135M-Instruct", "HuggingFaceTB--SmolLM2-135M-Instruct"]
    slugs = {f: family_slug(f) for f in families}
    assert len(set(slugs.values())) == len(families), sorted(slugs.items(), key=lambda kv: kv[1])
    # the pairs a plain "replace / with --" would merge
    assert family_slug("a/b") != family_slug("a--b")
    assert family_slug("a-/b") != family_slug("a/-b")
    assert family_slug("a b") != family_slug("a-b") != family_slug("a:b")


def test_an_unsafe_family_keeps_a_readable_part_and_its_own_hash():
    digest = hashlib.sha256("org/name v1".encode()).hexdigest()[:10]
    assert family_slug("org/name v1") == f"org--name-v1-{digest}"
    assert family_slug("a--b") == f"a--b-{hashlib.sha256(b'a--b').hexdigest()[:10]}"
    assert family_slug("../../etc/passwd").startswith("etc--passwd-")
    long = family_slug("x" * 300)
    assert long.startswith("x" * 100) and long != family_slug("x" * 301)


def test_the_slug_is_deterministic_across_processes():
    """Another process (a restarted trainer, the arena on another host) must name a family's files alike."""
    fams = ["HuggingFaceTB/SmolLM2-135M-Instruct", "org/name v1", "x" * 300]
    out = subprocess.run([sys.executable, "-c", "import sys; from schemas.policy import family_slug; "
                          "print('\\n'.join(family_slug(f) for f in sys.argv[1:]))", *fams],
                         cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.split()
    assert out == [family_slug(f) for f in fams]


def test_an_empty_family_is_refused():
    with pytest.raises(ValueError):
        family_slug("")
