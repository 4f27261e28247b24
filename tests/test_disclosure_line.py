"""A run's disclosure line (signing/spool.py) is exactly the JSON it always was, though its blobs are spliced in
rather than encoded (the splice is what keeps a 10 MB `%box_pull` within its time)."""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tkbox_nb.signing.spool import disclosure_line

TEXT = st.text(max_size=20)
JSONS = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(TEXT, JSONS, max_size=6), st.dictionaries(TEXT, st.binary(max_size=64), max_size=4))
def test_a_disclosure_line_is_the_json_its_entry_and_blobs_make(entry, raw):
    blobs = {digest: base64.b64encode(data).decode() for digest, data in raw.items()}
    whole = dict(entry, blobs=blobs) if blobs else entry
    line = disclosure_line(entry, blobs)
    assert line == json.dumps(whole, sort_keys=True, ensure_ascii=False) + "\n"
    assert json.loads(line) == whole
