"""Values moved by `%box_pull` / `%box_push`: numpy arrays, pandas DataFrames and Series as `.npy` arrays and a
small strict JSON header, plain JSON otherwise; read back exactly, or refused in one line.

Before, a value crossed as whatever the box's IPython made of it as JSON: a DataFrame came back as its column names,
an array as a list. A format that can carry any object (pickle) would run the box's code on the host. So: an array
is `.npy` bytes read with our own checks, never with `allow_pickle` (numeric, bool, datetime64/timedelta64, fixed
width unicode `U` and bytes `S`; an object array only when every element is a str, carried as `U` and given back as
object); a DataFrame is each column as such an array, its index and column labels as indexes, and its dtypes named
in the header (numpy dtypes, `category` as codes and categories, pandas' `string`/`str` as `U` with a mask of
missing values, time-zone-aware datetimes as UTC instants and the zone's name, an index's `freq` by its name).
Everything else (a MultiIndex, an object column of mixed types, nested objects, nullable integers) is refused naming
why: a value is never changed on the way.

`decode` reads what the box sent, so it is hostile input: strict shapes and types, the npy header parsed by us (its
version, a plain dtype, the shape's product times the item size exactly the bytes given), lengths that agree, a
limit on the bytes, and every column's dtype after the DataFrame is built compared with what was sent. It is pure
(sans-IO) and imports nothing of this package: the same source is run in the box (sent in the move's cell) to encode
what is pulled and decode what is pushed.
"""

from __future__ import annotations

import base64
import io
import math
import sys

try:
    import numpy as np
    from numpy.lib import format as npf
except ImportError:  # a box without numpy still moves plain values
    np = npf = None

MAX_COLUMNS = 10_000
MAX_NDIM = 32
MAX_DEPTH = 100
MAX_HEADER = 4096
NUMPY_KINDS = "biufcmMUS"


class ValueCodecError(ValueError):
    """A value that is not carried (said in one line, naming why)."""


def _pandas():
    return sys.modules.get("pandas")


# -- plain values ------------------------------------------------------------------------------------------------
def plain_refusal(value, depth: int = 0) -> str | None:
    """Why `value` would not read back the same from JSON (a tuple, a set, a non-str key, NaN, ...), or None."""
    if depth > MAX_DEPTH:
        return f"nested more than {MAX_DEPTH} deep"
    t = type(value)
    if value is None or t in (bool, int, str):
        return None
    if t is float:
        return None if math.isfinite(value) else f"{value} is not JSON"
    if t is list:
        return next((w for w in (plain_refusal(v, depth + 1) for v in value) if w), None)
    if t is dict:
        if any(type(k) is not str for k in value):
            return "a dict key that is not a str (JSON makes it one)"
        return next((w for w in (plain_refusal(v, depth + 1) for v in value.values()) if w), None)
    return f"a {t.__module__}.{t.__qualname__} is not carried (plain data, a numpy array, a DataFrame or a Series)"


# -- arrays ------------------------------------------------------------------------------------------------------
def _npy(arr) -> str:
    if arr.dtype.kind == "O":
        arr = _object_str(arr)
    if arr.dtype.kind not in NUMPY_KINDS or arr.dtype.fields is not None or arr.dtype.subdtype is not None:
        raise ValueCodecError(f"an array of dtype {arr.dtype} is not carried (numeric, bool, datetime64, "
                              "timedelta64, str or bytes)")
    buf = io.BytesIO()
    npf.write_array(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _object_str(arr):
    flat = arr.ravel()
    if not all(type(v) is str for v in flat):
        kinds = sorted({type(v).__name__ for v in flat})[:4]
        raise ValueCodecError(f"an object array holding {', '.join(kinds)} is not carried (only all-str)")
    if any(v.endswith("\x00") for v in flat):
        raise ValueCodecError("a str ending in NUL is not carried (numpy's str arrays drop it)")
    return np.array(arr.tolist() if arr.ndim else arr[()], dtype=str)


def _b64(text, budget: list[int]) -> bytes:
    if not isinstance(text, str) or len(text) > budget[0] * 4 // 3 + 8:
        raise ValueCodecError("an array is not base64 text within the limit")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueCodecError("an array is not base64 text") from None
    budget[0] -= len(data)
    if budget[0] < 0:
        raise ValueCodecError("the value is over the size limit")
    return data


def read_npy(data: bytes, max_items: int):
    """An array from `.npy` bytes, checked: version 1.0/2.0, a plain dtype, the bytes exactly the shape's."""
    if np is None:
        raise ValueCodecError("numpy is not installed here")
    f = io.BytesIO(data)
    try:
        version = npf.read_magic(f)
        read = {(1, 0): npf.read_array_header_1_0, (2, 0): npf.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueCodecError(f"npy version {version} is not read")
        shape, fortran, dtype = read(f, max_header_size=MAX_HEADER)
    except ValueCodecError:
        raise
    except Exception as e:  # numpy's own header checks: ValueError, SyntaxError from literal_eval, ...
        raise ValueCodecError(f"not an npy array: {str(e)[:100]}") from None
    if dtype.kind not in NUMPY_KINDS or dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        raise ValueCodecError(f"an array of dtype {dtype} is not carried")
    if len(shape) > MAX_NDIM or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueCodecError("an array's shape is not valid")
    count = math.prod(shape)
    body = data[f.tell():]
    if count > max_items or count * dtype.itemsize != len(body):
        raise ValueCodecError(f"an array's header says {shape} of {dtype}, its data is {len(body)} bytes")
    if dtype.kind == "U" and body:
        points = np.frombuffer(body, dtype.byteorder.replace("=", "<").replace("|", "<") + "u4")
        if int(points.max()) > 0x10FFFF:
            raise ValueCodecError("a str array holds a code point past U+10FFFF")
    arr = np.frombuffer(bytearray(body), dtype=dtype, count=count)
    return arr.reshape(shape[::-1]).transpose() if fortran else arr.reshape(shape)


def _array(obj, budget, ndim: int | None = None, length: int | None = None):
    arr = read_npy(_b64(obj, budget), budget[1])
    if ndim is not None and arr.ndim != ndim:
        raise ValueCodecError(f"an array of shape {arr.shape} where a {ndim}-dimensional one was said")
    if length is not None and arr.shape[0] != length:
        raise ValueCodecError(f"an array of shape {arr.shape} where {length} values were said")
    return arr


# -- pandas columns and indexes ----------------------------------------------------------------------------------
def _label(x):
    if x is None or type(x) in (str, bool, int) or type(x) is float and math.isfinite(x):
        return x
    raise ValueCodecError(f"a name of type {type(x).__name__} is not carried (str, int, float, bool or None)")


def _column(values) -> dict:
    """One column (a Series' or an Index's values) as JSON with its arrays."""
    pd = _pandas()
    dtype = values.dtype
    if isinstance(dtype, np.dtype):
        arr = np.asarray(values)
        if dtype.kind == "O":
            return {"dtype": "object-str", "npy": _npy(_object_str(arr))}
        return {"dtype": "numpy", "npy": _npy(arr)}
    if isinstance(dtype, pd.CategoricalDtype):
        if isinstance(dtype.categories.dtype, pd.CategoricalDtype):
            raise ValueCodecError("categories that are themselves categorical are not carried")
        return {"dtype": "category", "ordered": bool(dtype.ordered), "codes": _npy(np.asarray(values.array.codes)),
                "categories": _index(dtype.categories)}
    if isinstance(dtype, pd.DatetimeTZDtype):  # the instants in UTC, and the zone's name
        utc = np.asarray(pd.DatetimeIndex(values).tz_convert("UTC").tz_localize(None))
        return {"dtype": "datetimetz", "tz": _tz_name(str(dtype.tz)), "npy": _npy(utc)}
    if isinstance(dtype, pd.StringDtype):
        obj = np.asarray(values, dtype=object)
        mask = np.asarray(pd.isna(obj), dtype=bool)
        obj = np.where(mask, "", obj)
        return {"dtype": "string", "storage": dtype.storage, "na": "nan" if dtype.na_value is not pd.NA else "NA",
                "npy": _npy(_object_str(obj)), "mask": _npy(mask)}
    raise ValueCodecError(f"a column of dtype {dtype} is not carried")


def _tz_name(tz) -> str:
    """A time zone's name as the tz database spells it (`Europe/Paris`, `UTC`, `+01:00`): never a path."""
    if not isinstance(tz, str) or not 0 < len(tz) <= 64 or ".." in tz or tz.startswith("/") \
            or not all(c.isascii() and (c.isalnum() or c in "_+-/:") for c in tz):
        raise ValueCodecError(f"a time zone {str(tz)[:70]!r} is not carried (a tz database name or an offset)")
    return tz


def _freq_name(freq) -> str:
    if not isinstance(freq, str) or not 0 < len(freq) <= 32 or \
            not all(c.isascii() and (c.isalnum() or c == "-") for c in freq):
        raise ValueCodecError(f"an index freq {str(freq)[:40]!r} is not carried")
    return freq


def _read_column(obj, budget, n: int):
    pd = _pandas()
    if not isinstance(obj, dict) or not isinstance(obj.get("dtype"), str):
        raise ValueCodecError("a column is not an object with a dtype")
    kind, keys = obj["dtype"], set(obj)
    want = {"numpy": {"npy"}, "object-str": {"npy"}, "category": {"ordered", "codes", "categories"},
            "datetimetz": {"tz", "npy"},
            "string": {"storage", "na", "npy", "mask"}}.get(kind)
    if want is None or keys != want | {"dtype"}:
        raise ValueCodecError(f"a column of kind {kind[:40]!r} with fields {sorted(keys)[:8]} is not read")
    if kind == "numpy":
        arr = _array(obj["npy"], budget, 1, n)
        if arr.dtype.kind in "US":
            raise ValueCodecError("a pandas column of numpy str or bytes is not one pandas makes")
        return arr
    if kind == "object-str":
        arr = _array(obj["npy"], budget, 1, n)
        if arr.dtype.kind != "U":
            raise ValueCodecError("an object-str column not sent as str")
        return arr.astype(object)
    if kind == "category":
        codes = _array(obj["codes"], budget, 1, n)
        cats = _read_index(obj["categories"], budget, None)
        if codes.dtype.kind != "i" or type(obj["ordered"]) is not bool or isinstance(cats, pd.MultiIndex):
            raise ValueCodecError("a category column with codes not integers")
        if codes.size and (int(codes.min()) < -1 or int(codes.max()) >= len(cats)):
            raise ValueCodecError("a category code past its categories")
        return pd.Categorical.from_codes(codes, dtype=pd.CategoricalDtype(cats, ordered=obj["ordered"]))
    if kind == "datetimetz":
        arr = _array(obj["npy"], budget, 1, n)
        if arr.dtype.kind != "M":
            raise ValueCodecError("a datetimetz column not sent as datetime64")
        return pd.DatetimeIndex(arr).tz_localize("UTC").tz_convert(_tz_name(obj["tz"])).array
    if obj["storage"] != "python" or obj["na"] not in ("nan", "NA"):
        raise ValueCodecError(f"a string column of storage {str(obj['storage'])[:20]!r} is not read (only python)")
    arr, mask = _array(obj["npy"], budget, 1, n), _array(obj["mask"], budget, 1, n)
    if arr.dtype.kind != "U" or mask.dtype.kind != "b":
        raise ValueCodecError("a string column not sent as str with a bool mask")
    values = arr.astype(object)
    na = np.nan if obj["na"] == "nan" else pd.NA
    values[mask] = na
    return pd.array(values, dtype=pd.StringDtype("python", na_value=na))


def _index(index) -> dict:
    pd = _pandas()
    if isinstance(index, pd.MultiIndex):
        raise ValueCodecError("a MultiIndex is not carried (reset_index() first)")
    if type(index) is pd.RangeIndex:
        return {"type": "range", "start": index.start, "stop": index.stop, "step": index.step,
                "name": _label(index.name)}
    out = {"type": "index", "name": _label(index.name), "values": _column(index)}
    if getattr(index, "freq", None) is not None:  # a DatetimeIndex or TimedeltaIndex made with a frequency
        out["freq"] = _freq_name(index.freqstr)
    return out


def _read_index(obj, budget, n: int | None):
    pd = _pandas()
    if not isinstance(obj, dict) or obj.get("type") not in ("range", "index"):
        raise ValueCodecError("an index is not a range or an index")
    name = _read_label(obj.get("name"))
    if obj["type"] == "range":
        if set(obj) != {"type", "start", "stop", "step", "name"}:
            raise ValueCodecError("a range index with other fields")
        ends = (obj["start"], obj["stop"], obj["step"])
        if not all(type(x) is int and abs(x) < 1 << 63 for x in ends) or ends[2] == 0:
            raise ValueCodecError("a range index that is not three integers")
        index = pd.RangeIndex(*ends, name=name)
        if len(index) > budget[1]:
            raise ValueCodecError(f"a range index of {len(index)} labels, over the limit")
        if n is not None and len(index) != n:
            raise ValueCodecError(f"an index of {len(index)} labels for {n} rows")
        return index
    if set(obj) - {"freq"} != {"type", "name", "values"}:
        raise ValueCodecError("an index with other fields")
    values = obj["values"]
    if isinstance(values, dict) and values.get("dtype") == "category":
        raise ValueCodecError("a categorical index is not read")
    if n is None:
        n = _length(values, budget)
    col = _read_column(values, budget, n)
    try:
        index = pd.Index(col, dtype=col.dtype, name=name, copy=False)
    except Exception as e:  # a dtype pandas keeps in no index (float16, ...)
        raise ValueCodecError(f"an index of dtype {col.dtype} is not made: {str(e)[:80]}") from None
    if index.dtype != col.dtype:
        raise ValueCodecError(f"an index of dtype {col.dtype} would become {index.dtype}")
    if "freq" in obj:  # pandas checks that the labels keep to it (else ValueError: refused)
        if col.dtype.kind not in "Mm":
            raise ValueCodecError("a freq on an index not of datetimes or timedeltas")
        offset = pd.tseries.frequencies.to_offset(_freq_name(obj["freq"]))
        index = (pd.DatetimeIndex if col.dtype.kind == "M" else pd.TimedeltaIndex)(index, freq=offset, name=name)
    return index


def _length(column, budget) -> int:
    """The length of categories (an index whose length no frame says): the first array's own."""
    key = "npy" if isinstance(column, dict) and "npy" in column else None
    if key is None:
        raise ValueCodecError("categories are not an array")
    arr = read_npy(_b64(column[key], [budget[0], budget[1]]), budget[1])
    if arr.ndim != 1:
        raise ValueCodecError("categories are not one-dimensional")
    return arr.shape[0]


def _read_label(x):
    if x is None or type(x) in (str, bool, int) and (type(x) is not int or abs(x) < 1 << 63) \
            or type(x) is float:
        return x
    raise ValueCodecError("a name that is not a str, number, bool or null")


# -- values ------------------------------------------------------------------------------------------------------
def is_plain(value) -> bool:
    return plain_refusal(value) is None


def encode(value) -> dict:
    """The JSON form of one value, or ValueCodecError naming why it is not carried."""
    pd = _pandas()
    if np is not None and isinstance(value, np.ndarray):
        return {"kind": "ndarray-object-str" if value.dtype.kind == "O" else "ndarray", "npy": _npy(value)}
    if np is not None and isinstance(value, np.generic):
        return {"kind": "scalar", "npy": _npy(np.asarray(value))}
    if pd is not None and isinstance(value, pd.Series):
        return {"kind": "series", "name": _label(value.name), "index": _index(value.index),
                "data": _column(value)}
    if pd is not None and isinstance(value, pd.DataFrame):
        if len(value.columns) > MAX_COLUMNS:
            raise ValueCodecError(f"more than {MAX_COLUMNS} columns")
        return {"kind": "frame", "index": _index(value.index), "columns": _index(value.columns),
                "data": [_column(value.iloc[:, i]) for i in range(value.shape[1])]}
    why = plain_refusal(value)
    if why:
        raise ValueCodecError(why)
    return {"kind": "json", "value": value}


def decode(entry, limit: int):
    """The value of one JSON form (hostile: checked), at most `limit` bytes of arrays; or ValueCodecError."""
    try:
        return _decode(entry, limit)
    except ValueCodecError:
        raise
    except Exception as e:  # numpy's or pandas' own checks of what they were given: still a refusal
        raise ValueCodecError(f"not read: {type(e).__name__}: {str(e)[:100]}") from None


def _decode(entry, limit: int):
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        raise ValueCodecError("a value is not an object with a kind")
    kind, keys = entry["kind"], set(entry)
    want = {"json": {"value"}, "ndarray": {"npy"}, "ndarray-object-str": {"npy"}, "scalar": {"npy"},
            "series": {"name", "index", "data"},
            "frame": {"index", "columns", "data"}}.get(kind)
    if want is None or keys != want | {"kind"}:
        raise ValueCodecError(f"a value of kind {kind[:40]!r} with fields {sorted(keys)[:8]} is not read")
    if kind == "json":
        return entry["value"]
    budget = [limit, limit]  # bytes left, items an array may hold
    if kind in ("ndarray", "ndarray-object-str", "scalar"):
        arr = _array(entry["npy"], budget, 0 if kind == "scalar" else None)
        if kind == "ndarray-object-str":
            if arr.dtype.kind != "U":
                raise ValueCodecError("an object array not sent as str")
            return arr.astype(object)
        return arr[()] if kind == "scalar" else arr
    pd = _pandas()
    if pd is None:
        import pandas as pd  # noqa: F811  (a Series or DataFrame was sent: pandas is needed to hold it)
    return _frame(pd, entry, kind, budget)


def _frame(pd, entry, kind, budget):
    if kind == "series":
        index = _read_index(entry["index"], budget, _rows(entry["index"], budget))
        col = _read_column(entry["data"], budget, len(index))
        series = pd.Series(col, index=index, name=_read_label(entry["name"]), dtype=col.dtype, copy=False)
        _same_dtype(series.dtype, col.dtype)
        return series
    data = entry["data"]
    if not isinstance(data, list) or len(data) > MAX_COLUMNS:
        raise ValueCodecError(f"a frame's columns are not a list of at most {MAX_COLUMNS}")
    index = _read_index(entry["index"], budget, _rows(entry["index"], budget))
    columns = _read_index(entry["columns"], budget, len(data))
    cols = [_read_column(c, budget, len(index)) for c in data]
    if cols:  # built on a fresh RangeIndex, so nothing is aligned (the index may repeat labels)
        frame = pd.concat([pd.Series(c, dtype=c.dtype, copy=False) for c in cols], axis=1)
        frame.index = index
    else:
        frame = pd.DataFrame(index=index)
    frame.columns = columns
    for i, c in enumerate(cols):
        _same_dtype(frame.dtypes.iloc[i], c.dtype)
    return frame


def _rows(index, budget) -> int | None:
    if not isinstance(index, dict):
        raise ValueCodecError("an index is not an object")
    if index.get("type") == "range":
        return None
    return _length(index.get("values"), budget)


def _same_dtype(got, sent) -> None:
    if got != sent:
        raise ValueCodecError(f"a column of dtype {sent} would become {got}")
