"""rules/value_codec.py: what %box_pull and %box_push carry (numpy arrays, DataFrames, Series, plain JSON) reads back
exactly, and what a box sends instead (a pickle, a header that lies, too much) is refused in one line."""

from __future__ import annotations

import base64
import io
import json
import pickle

import numpy as np
import pandas as pd
import pytest

from tkbox_nb.rules.value_codec import ValueCodecError, decode, encode, plain_refusal

LIMIT = 16 << 20


def again(value):
    return decode(json.loads(json.dumps(encode(value))), LIMIT)


def npy(header: str, body: bytes, version: bytes = b"\x01\x00") -> str:
    head = header.encode().ljust(117) + b"\n"
    return base64.b64encode(b"\x93NUMPY" + version + len(head).to_bytes(2, "little") + head + body).decode()


def frame():
    df = pd.DataFrame({"i": np.arange(3, dtype="int64"), "f": np.array([1.5, 2, np.nan], "float32"),
                       "b": [True, False, True], "s": ["a", None, "c"],
                       "t": pd.to_datetime(["2020-01-01", "2021-06-01", None]).astype("M8[ns]"),
                       "d": pd.to_timedelta([1, 2, 3], unit="s"), "c": pd.Categorical(["u", "v", "u"], ordered=True)},
                      index=pd.Index([10, 20, 10], name="key"))
    df["o"] = pd.Series(["x", "y", "z"], index=df.index).astype(object)
    return df


def test_a_dataframe_reads_back_exactly():
    df = frame()
    out = again(df)
    pd.testing.assert_frame_equal(out, df)
    assert list(out.dtypes) == list(df.dtypes) and out.index.name == "key" and out["o"].dtype == object


@pytest.mark.parametrize("df", [pd.DataFrame(np.zeros((2, 3))), pd.DataFrame(), pd.DataFrame(index=[1, 2]),
                                pd.DataFrame([[1, 2]], columns=["a", "a"]),
                                pd.DataFrame({"x": [1.0]}, index=pd.RangeIndex(5, 6, name="r"))])
def test_frames_of_every_shape_read_back_exactly(df):
    pd.testing.assert_frame_equal(again(df), df)


def test_a_named_series_reads_back_exactly():
    s = pd.Series([0.5, 1.5], index=pd.Index(["p", "q"], name="k"), name="weights")
    pd.testing.assert_series_equal(again(s), s)
    s = pd.Series(pd.to_datetime(["2020-01-01"]).astype("M8[ns]"), name=3)
    pd.testing.assert_series_equal(again(s), s)


@pytest.mark.parametrize("arr", [np.arange(6.0).reshape(2, 3), np.array(3.5), np.array(7, "uint8"),
                                 np.array(["ab", "c"]), np.array([b"x", b"yz"]), np.array([True, False]),
                                 np.array(["2020-01-01"], "M8[ns]"), np.array([5], "m8[s]"), np.array([1 + 2j]),
                                 np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)), np.zeros((0, 4), "i2")])
def test_arrays_read_back_with_their_dtype(arr):
    out = again(arr)
    assert type(out) is np.ndarray and out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr, strict=True)
    out[...] = arr  # writable


@pytest.mark.parametrize("value", [
    pd.Series([1.0, 2.0], index=pd.date_range("2020", periods=2, freq="D", name="day")),
    pd.DataFrame({"t": pd.date_range("2020", periods=3, freq="h", tz="Europe/Paris")},
                 index=pd.timedelta_range("1s", periods=3, freq="2s")),
    pd.Series(pd.to_datetime(["2020-01-01", None]).tz_localize("UTC"), name="when"),
    pd.DataFrame({"x": [1, 2]}, index=pd.date_range("2020-01-31", periods=2, freq="ME", tz="+01:00"))])
def test_time_zones_and_an_index_s_freq_read_back_exactly(value):
    out = again(value)
    (pd.testing.assert_series_equal if isinstance(value, pd.Series) else pd.testing.assert_frame_equal)(out, value)
    assert getattr(out.index, "freq", None) == getattr(value.index, "freq", None)


def test_numpy_scalars_and_object_str_arrays_keep_their_type():
    for v in (np.float32(2.5), np.int64(-3), np.str_("s"), np.bool_(True)):
        assert type(again(v)) is type(v) and again(v) == v
    obj = np.array(["a", "bc"], dtype=object)
    out = again(obj)
    assert out.dtype == object and out.tolist() == ["a", "bc"]


def test_plain_values_are_plain_json():
    for v in (None, 1, -2.5, "s", [1, {"a": None, "b": [True]}]):
        assert encode(v) == {"kind": "json", "value": v} and again(v) == v


@pytest.mark.parametrize("value, why", [
    ((1, 2), "builtins.tuple is not carried"), ({1: "a"}, "a dict key that is not a str"),
    (float("nan"), "nan is not JSON"), ({"a": {1, 2}}, "builtins.set is not carried"),
    (np.array([1, "a"], dtype=object), "an object array holding int, str"),
    (np.array(["a\x00"], dtype=object), "ending in NUL"),
    (np.zeros(2, dtype=[("a", "i4")]), "dtype"),
    (pd.DataFrame({"a": [1], "b": [2]}).set_index(["a", "b"]), "a MultiIndex is not carried"),
    (pd.DataFrame({"m": np.array([1, "a"], dtype=object)}), "an object array holding int, str"),
    (pd.Series([1, None], dtype="Int64"), "a column of dtype Int64 is not carried"),
    (pd.Series(pd.period_range("2020", periods=1)),
     "a column of dtype period[D] is not carried"),
    (pd.DataFrame({("a", "b"): [1]}), "MultiIndex"),
    (pd.Series([1], name=("a", 1)), "a name of type tuple"),
])
def test_what_cannot_read_back_exactly_is_refused_naming_why(value, why):
    with pytest.raises(ValueCodecError, match=None) as e:
        encode(value)
    assert why in str(e.value) and "\n" not in str(e.value)


def _frame_entry(column: dict, rows: int = 2) -> dict:
    return {"kind": "frame", "index": {"type": "range", "start": 0, "stop": rows, "step": 1, "name": None},
            "columns": {"type": "range", "start": 0, "stop": 1, "step": 1, "name": None}, "data": [column]}


I8 = "{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }"
HOSTILE = {
    "a pickle": {"kind": "ndarray", "npy": base64.b64encode(pickle.dumps(np.arange(3))).decode()},
    "npy with allow_pickle's object dtype": {"kind": "ndarray", "npy": npy(
        "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", pickle.dumps([1]))},
    "a shape over the bytes": {"kind": "ndarray", "npy": npy(I8 % 1000, bytes(16))},
    "bytes past the shape": {"kind": "ndarray", "npy": npy(I8 % 1, bytes(16))},
    "a structured dtype": {"kind": "ndarray", "npy": npy(
        "{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (1,), }", bytes(4))},
    "a negative dimension": {"kind": "ndarray", "npy": npy(I8 % -1, b"")},
    "a header that is code": {"kind": "ndarray", "npy": npy("__import__('os').system('id')", b"")},
    "npy version 3": {"kind": "ndarray", "npy": npy(I8 % 0, b"", b"\x03\x00")},
    "a billion empty strings": {"kind": "ndarray", "npy": npy(
        "{'descr': '|S0', 'fortran_order': False, 'shape': (1099511627776,), }", b"")},
    "a code point past U+10FFFF": {"kind": "ndarray", "npy": npy(
        "{'descr': '<U1', 'fortran_order': False, 'shape': (1,), }", b"\xff\xff\xff\x7f")},
    "not base64": {"kind": "ndarray", "npy": "!!!!"},
    "a scalar that is not 0-d": {"kind": "scalar", "npy": npy(I8 % 1, bytes(8))},
    "an unknown kind": {"kind": "pickle", "data": ""},
    "an extra field": {"kind": "ndarray", "npy": npy(I8 % 0, b""), "eval": "x"},
    "a column longer than the index": _frame_entry({"dtype": "numpy", "npy": npy(I8 % 3, bytes(24))}),
    "a numpy str column pandas never makes": _frame_entry({"dtype": "numpy", "npy": npy(
        "{'descr': '<U1', 'fortran_order': False, 'shape': (2,), }", bytes(8))}),
    "a column that says object-str but holds ints": _frame_entry({"dtype": "object-str", "npy": npy(I8 % 2,
                                                                                                    bytes(16))}),
    "a category code past its categories": _frame_entry({"dtype": "category", "ordered": False,
                                                         "codes": npy(I8 % 2, (5).to_bytes(8, "little") * 2),
                                                         "categories": {"type": "range", "start": 0, "stop": 2,
                                                                        "step": 1, "name": None}}),
    "a datetime column pandas would change": _frame_entry({"dtype": "numpy", "npy": npy(
        "{'descr': '<M8[D]', 'fortran_order': False, 'shape': (2,), }", bytes(16))}),
    "a range index of 2**62 rows": {"kind": "frame", "index": {"type": "range", "start": 0, "stop": 1 << 62,
                                                               "step": 1, "name": None},
                                    "columns": {"type": "range", "start": 0, "stop": 0, "step": 1, "name": None},
                                    "data": []},
    "a name that is an object": {"kind": "series", "name": {"a": 1}, "data": {"dtype": "numpy", "npy": npy(
        I8 % 0, b"")}, "index": {"type": "range", "start": 0, "stop": 0, "step": 1, "name": None}},
    "not an object": ["kind", "json"],
    "a freq the labels do not keep": {"kind": "series", "name": None, "data": {"dtype": "numpy", "npy": npy(
        I8 % 2, bytes(16))}, "index": {"type": "index", "name": None, "freq": "D", "values": {"dtype": "numpy",
                                       "npy": npy("{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (2,), }",
                                                  bytes(8) + (1).to_bytes(8, "little"))}}},
    "a time zone that is a path": _frame_entry({"dtype": "datetimetz", "tz": "../../../etc/passwd", "npy": npy(
        "{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (2,), }", bytes(16))}),
    "a time zone that does not exist": _frame_entry({"dtype": "datetimetz", "tz": "Nowhere/Atlantis", "npy": npy(
        "{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (2,), }", bytes(16))}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_value_is_refused_in_one_line(case):
    with pytest.raises(ValueCodecError) as e:
        decode(HOSTILE[case], LIMIT)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_arrays_over_the_limit_are_refused():
    entry = json.loads(json.dumps(encode(np.zeros(1000))))
    assert decode(entry, 8128).shape == (1000,)  # the npy header and the data
    with pytest.raises(ValueCodecError, match="limit"):
        decode(entry, 8127)
    df = json.loads(json.dumps(encode(pd.DataFrame({"a": np.zeros(600), "b": np.zeros(600)}))))
    with pytest.raises(ValueCodecError, match="limit"):
        decode(df, 8000)  # each column under it, both over


def test_plain_refusal_is_none_for_json_and_a_reason_otherwise():
    assert plain_refusal({"a": [1, 2.5, None, True, "s"]}) is None
    nested: list = []
    for _ in range(200):
        nested = [nested]
    assert "nested more than" in plain_refusal(nested)
    assert io  # the module's reader is fed bytes, never a file
