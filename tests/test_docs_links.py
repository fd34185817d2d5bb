"""The README and docs/ pages link to files and sections that exist (GitHub's heading anchors),
and the README stays an entry point (under 300 lines; the rest lives in docs/)."""

import glob
import os
import re

import pytest

from tests.helpers import REPO

PAGES = ['README.md'] + sorted(os.path.relpath(p, REPO)
                               for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))


def anchor(heading: str) -> str:
  """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def anchors(page: str) -> set:
  text = re.sub(r'```.*?```', '', open(os.path.join(REPO, page)).read(), flags=re.DOTALL)
  return {anchor(h) for h in re.findall(r'^#{1,6} (.+)$', text, flags=re.MULTILINE)}


def test_anchor_of_a_heading_with_code_and_punctuation():
  assert anchor('Will it fit? `python -m upcycle.aot`') == 'will-it-fit-python--m-upcycleaot'


@pytest.mark.parametrize('page', PAGES)
def test_every_relative_link_resolves(page):
  text = re.sub(r'```.*?```', '', open(os.path.join(REPO, page)).read(), flags=re.DOTALL)
  broken = []
  for target in re.findall(r'\]\(([^)\s]+)\)', text):
    if re.match(r'[a-z]+://', target):
      continue
    path, _, section = target.partition('#')
    linked = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(os.path.join(REPO, linked)):
      broken.append(f'{target}: no file {linked}')
    elif section and linked.endswith('.md') and section not in anchors(linked):
      broken.append(f'{target}: no section #{section} in {linked}')
  assert not broken, f'{page}: ' + '; '.join(broken)


def test_the_readme_is_an_entry_point():
  assert len(open(os.path.join(REPO, 'README.md')).read().splitlines()) < 300
