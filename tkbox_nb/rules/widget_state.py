"""What of a widget's state from the box the frontend may load: the standard widgets' own keys, nothing it renders
as markup or outputs unchecked, no link between widgets, no capture of another request's outputs.

The frontend's widget manager makes a model of whatever class a comm_open (or the control comm's `update_states`, on
page load) names, and its views render that model's keys: an HTML widget's `value` as HTML, an Output widget's
`outputs` as trusted outputs, in the notebook's origin (docs/threat-model.md, I56). So the host checks each widget's
state from the box before the frontend sees it:
- A link (`LinkModel`, `DirectionalLinkModel`: `jslink`, `jsdlink`) is refused whole: the frontend would copy one
  widget's key into another's, so a value the host checked as a Text's would land in an Output's `outputs` or an
  HTML's `value` unchecked. Refused too: a widget whose model or view name or module is not text (the frontend's
  lookup `module[name]` reads `["LinkModel"]` as `LinkModel`) and a model of a standard module that is no standard
  widget's (`KEYS`); a refused comm's later messages are refused with it (`REFUSED`), never forwarded.
- Of a standard model's state only the keys its model defines pass (`KEYS`, ipywidgets 8's synced traits, a table
  `tests/test_box_messages.py` checks against the installed ipywidgets), so no extra key rides along for the frontend
  to use in a way the host did not check.
- `msg_id` (an Output widget captures the outputs of the request it names) may name only a request the box was sent:
  never a host cell's, whose outputs the frontend would put into the widget and sync back into the box.
- A Style or Layout model's values are CSS the frontend sets on an element: one naming a CSS function other than
  colours and arithmetic (`url(...)`, `image-set(...)`), or with a CSS escape, is dropped, as a browser would fetch
  its URL with no click, past the egress door.
- As before: an HTML or HTMLMath widget's `value` is sanitised as HTML outputs are (output_sanitiser.clean_html), every
  `description_allow_html` is off, an Output widget's `outputs` go through the mimebundle allowlist, no `format:
  "url"` stays, and no binary buffer sets a key the host checks (`widget_buffers`).

Pure functions of their input; which widget a comm message updates, and which requests the box was sent, come from
the caller (doors/cell.py tracks the box's comms, `widget_kind`).
"""

from __future__ import annotations

import re
from collections.abc import Container
from typing import Any

from tkbox_nb.rules.output_sanitiser import clean_html, outputs

HTML_WIDGETS = frozenset({"HTMLModel", "HTMLMathModel", "HTMLView", "HTMLMathView"})
OUTPUT_WIDGETS = frozenset({"OutputModel", "OutputView"})
MAX_WIDGET_NAMES = 8  # names a comm's kind keeps; past them, or on a name that is not text, it is ANY_WIDGET
ANY_WIDGET = "*"  # a comm whose widget is not known: its state is sanitised as every kind's (HTML, Output)
REFUSED = "!"  # the kind of a comm whose comm_open was refused: its later messages are refused too
LINK_MODELS = frozenset({"LinkModel", "DirectionalLinkModel"})
STANDARD_MODULES = frozenset({"@jupyter-widgets/base", "@jupyter-widgets/controls", "@jupyter-widgets/output"})
_NAME_KEYS = ("_model_name", "_view_name", "_model_module", "_view_module")
# keys of widget state the host checks: a comm message may not set them from a binary buffer (buffer_paths) instead
_CHECKED_KEYS = frozenset({*_NAME_KEYS, "description_allow_html", "format", "outputs", "msg_id"})
_COMMON = frozenset({"_model_module", "_model_module_version", "_model_name", "_view_count", "_view_module",
                     "_view_module_version", "_view_name"})
_SHORT = {"DOM": "_dom_classes layout tabbable tooltip", "DESC": "description description_allow_html style"}
# the synced keys of each standard model (ipywidgets 8, beyond _COMMON), by model name; links left out (refused)
_KEYS_TEXT = {
    "AccordionModel": "DOM box_style children selected_index titles",
    "AudioModel": "DOM autoplay controls format loop value", "BoolModel": "DOM DESC disabled value",
    "BoundedFloatTextModel": "DOM DESC continuous_update disabled max min step value",
    "BoundedIntTextModel": "DOM DESC continuous_update disabled max min step value",
    "BoxModel": "DOM box_style children selected_index titles",
    "ButtonModel": "DOM button_style description disabled icon style",
    "ButtonStyleModel": (
        "button_color font_family font_size font_style font_variant font_weight text_color text_decoration"),
    "CheckboxModel": "DOM DESC disabled indent value", "CheckboxStyleModel": "background description_width",
    "ColorPickerModel": "DOM DESC concise disabled value",
    "ColorsInputModel": "DOM DESC allow_duplicates allowed_tags placeholder value",
    "ComboboxModel": "DOM DESC continuous_update disabled ensure_option options placeholder value",
    "ControllerAxisModel": "DOM value", "ControllerButtonModel": "DOM pressed value",
    "ControllerModel": "DOM axes buttons connected index mapping name timestamp", "DOMWidgetModel": "DOM value",
    "DatePickerModel": "DOM DESC disabled max min step value", "DatetimeModel": "DOM DESC disabled max min value",
    "DescriptionModel": "DOM DESC _options_labels base disabled index max min step value",
    "DescriptionStyleModel": "description_width", "DropdownModel": "DOM DESC _options_labels disabled index",
    "FileUploadModel": "DOM DESC accept button_style disabled error icon multiple value",
    "FloatLogSliderModel": (
        "DOM DESC base behavior continuous_update disabled max min orientation readout readout_format step "
        "value"),
    "FloatProgressModel": "DOM DESC bar_style max min orientation value",
    "FloatRangeSliderModel": (
        "DOM DESC behavior continuous_update disabled max min orientation readout readout_format step value"),
    "FloatSliderModel": (
        "DOM DESC behavior continuous_update disabled max min orientation readout readout_format step value"),
    "FloatTextModel": "DOM DESC continuous_update disabled step value",
    "FloatsInputModel": "DOM DESC allow_duplicates allowed_tags format max min placeholder tag_style value",
    "GridBoxModel": "DOM box_style children", "HBoxModel": "DOM box_style children",
    "HTMLMathModel": "DOM DESC placeholder value",
    "HTMLMathStyleModel": "background description_width font_size text_color",
    "HTMLModel": "DOM DESC placeholder value", "HTMLStyleModel": "background description_width font_size text_color",
    "ImageModel": "DOM format height value width", "IntProgressModel": "DOM DESC bar_style max min orientation value",
    "IntRangeSliderModel": (
        "DOM DESC behavior continuous_update disabled max min orientation readout readout_format step value"),
    "IntSliderModel": (
        "DOM DESC behavior continuous_update disabled max min orientation readout readout_format step value"),
    "IntTextModel": "DOM DESC continuous_update disabled step value",
    "IntsInputModel": "DOM DESC allow_duplicates allowed_tags format max min placeholder tag_style value",
    "LabelModel": "DOM DESC placeholder value",
    "LabelStyleModel": (
        "background description_width font_family font_size font_style font_variant font_weight text_color "
        "text_decoration"),
    "LayoutModel": (
        "align_content align_items align_self border_bottom border_left border_right border_top bottom "
        "display flex flex_flow grid_area grid_auto_columns grid_auto_flow grid_auto_rows grid_column "
        "grid_gap grid_row grid_template_areas grid_template_columns grid_template_rows height "
        "justify_content justify_items left margin max_height max_width min_height min_width object_fit "
        "object_position order overflow padding right top visibility width"),
    "NaiveDatetimeModel": "DOM DESC disabled max min value",
    "NumbersInputBaseModel": "DOM DESC allow_duplicates allowed_tags max min placeholder tag_style value",
    "OutputModel": "DOM msg_id outputs", "PasswordModel": "DOM DESC continuous_update disabled placeholder value",
    "PlayModel": "DOM DESC disabled interval max min playing repeat show_repeat step value",
    "ProgressStyleModel": "bar_color description_width",
    "RadioButtonsModel": "DOM DESC _options_labels disabled index orientation",
    "SelectModel": "DOM DESC _options_labels disabled index rows",
    "SelectMultipleModel": "DOM DESC _options_labels disabled index rows",
    "SelectionRangeSliderModel": (
        "DOM DESC _options_labels behavior continuous_update disabled index orientation readout"),
    "SelectionSliderModel": "DOM DESC _options_labels behavior continuous_update disabled index orientation readout",
    "SliderStyleModel": "description_width handle_color", "StackModel": "DOM box_style children selected_index titles",
    "StringModel": "DOM DESC placeholder value",
    "StringStyleModel": "background description_width font_size text_color", "StyleModel": "",
    "TabModel": "DOM box_style children selected_index titles",
    "TagsInputBaseModel": "DOM DESC allow_duplicates allowed_tags placeholder value",
    "TagsInputModel": "DOM DESC allow_duplicates allowed_tags placeholder tag_style value",
    "TextModel": "DOM DESC continuous_update disabled placeholder value",
    "TextStyleModel": "background description_width font_size text_color",
    "TextareaModel": "DOM DESC continuous_update disabled placeholder rows value",
    "TimeModel": "DOM DESC disabled max min step value",
    "ToggleButtonModel": "DOM DESC button_style disabled icon value",
    "ToggleButtonStyleModel": (
        "description_width font_family font_size font_style font_variant font_weight text_color "
        "text_decoration"),
    "ToggleButtonsModel": "DOM DESC _options_labels button_style disabled icons index tooltips",
    "ToggleButtonsStyleModel": "button_width description_width font_weight", "VBoxModel": "DOM box_style children",
    "ValidModel": "DOM DESC disabled readout value",
    "VideoModel": "DOM autoplay controls format height loop value width", "WidgetModel": "",
}
KEYS: dict[str, frozenset[str]] = {
    name: _COMMON | frozenset(" ".join(_SHORT.get(word, word) for word in keys.split()).split())
    for name, keys in _KEYS_TEXT.items()}
# CSS functions a Style or Layout value may name: colours and arithmetic, none that loads a URL
_CSS_FUNCTIONS = frozenset({"", "rgb", "rgba", "hsl", "hsla", "hwb", "lab", "lch", "oklab", "oklch", "color",
                            "calc", "min", "max", "clamp", "minmax", "repeat", "var", "fit-content"})
_CSS_FUNCTION = re.compile(r"([a-z0-9_-]*)\s*\(")


def refusal(state: dict, entry: dict | None = None) -> str | None:
    """Why the frontend must not make the widget a comm_open (or an `update_states` entry, `entry`, whose
    `model_name` and `model_module` choose its class) names with `state`, or None: a link, a name or module that is
    not text, a model of a standard module that no standard widget has."""
    names = {key: state.get(key) for key in _NAME_KEYS}
    models = [(names["_model_name"], names["_model_module"])]
    if entry is not None:
        names.update(model_name=entry.get("model_name"), model_module=entry.get("model_module"))
        models.append((names["model_name"], names["model_module"]))
    for key, value in names.items():
        if value is not None and not isinstance(value, str):
            return f"a {key} that is not text"
        if isinstance(value, str) and LINK_MODELS & set(value.split()):
            return "a link between widgets"
    for name, module in models:
        if name is not None and (module is None or module in STANDARD_MODULES) and name not in KEYS:
            return f"the model {name[:40]!r}, no standard widget's"
    return None


def widget_kind(known: str, state: Any) -> str:
    """The model and view names a widget's comm has had (`known`, space-separated) with those `state` sets: a view
    renders whatever model it is given, so an HTML view of a Text model renders its value as HTML. Every name the
    state sets counts, so a message is judged by the names it sets itself; past `MAX_WIDGET_NAMES` names, or with a
    name that is not text (nor None), it is `ANY_WIDGET` (which `widget_names` refuses to a comm that was not)."""
    names = set(known.split())
    if isinstance(state, dict):
        for key in ("_model_name", "_view_name"):
            value = state.get(key)
            if isinstance(value, str):
                names.update(value[:64].split()[:1])
            elif value is not None:
                names.add(ANY_WIDGET)
    if len(names) > MAX_WIDGET_NAMES:
        names = {ANY_WIDGET}
    return " ".join(sorted(names))


def widget_names(known: str, state: Any, what: str, dropped: list[str]) -> None:
    """Refuse, in place, the model and view names of a later message to a comm of kind `known` that would make it
    render markup it did not (HTML, HTMLMath, Output, or any widget, as past `MAX_WIDGET_NAMES`): the frontend keeps
    the state sent before, which was not sanitised for that kind. A comm is what its comm_open made it, within the
    names it may have; a name or module that is not text, or names a link, is refused too."""
    if not isinstance(state, dict):
        return
    for key in _NAME_KEYS:
        value = state.get(key)
        if key in state and value is not None and (not isinstance(value, str) or LINK_MODELS & set(value.split())):
            del state[key]
            dropped.append(f"{what}:{key} (not text, or a link)")
    before, after = set(known.split()), set(widget_kind(known, state).split())
    if any(_renders(after, kinds) and not _renders(before, kinds) for kinds in (HTML_WIDGETS, OUTPUT_WIDGETS)):
        for key in ("_model_name", "_view_name"):
            if key in state:
                del state[key]
                dropped.append(f"{what}:{key} (a widget that renders markup)")


def _renders(names: set[str], kinds: frozenset[str]) -> bool:
    return ANY_WIDGET in names or bool(names & kinds)


def model_keys(kind: str) -> frozenset[str] | None:
    """The keys a widget of `kind` may be sent: those of the standard models it names, None (any) when it names
    none (a third-party widget, whose keys the host does not know: docs/threat-model.md, I56)."""
    known = [KEYS[name] for name in kind.split() if name in KEYS]
    return frozenset().union(*known) if known else None


def _styled(kind: str) -> bool:
    return any(name in KEYS and (name == "LayoutModel" or name.endswith("StyleModel")) for name in kind.split())


def _inert_css(value: Any) -> bool:
    """A Style or Layout value the frontend may set as CSS: None, or text with no escape, comment or function but
    colours and arithmetic (a browser fetches a `url(...)` or `image-set(...)` by itself)."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    if not isinstance(value, str) or "\\" in value or "/*" in value:
        return False
    return all(m.group(1) in _CSS_FUNCTIONS for m in _CSS_FUNCTION.finditer(value.lower()))


def widget_state(kind: str, state: Any, what: str, dropped: list[str], requests: Container[str] = (),
                 models: str | None = None) -> None:
    """Sanitise, in place, widget state from the box for a comm of `kind` (`widget_kind` of what the comm had and
    this state, "" when not known); `requests`: the msg_ids of the requests the box was sent; `models`: the kind
    whose models' keys the state may set (`kind` when not given; the names the comm keeps, when a name was refused)."""
    if not isinstance(state, dict):
        return
    allowed = model_keys(kind if models is None else models)
    for key in [k for k in state if allowed is not None and k not in allowed]:
        del state[key]
        dropped.append(f"{what}:{str(key)[:40]} (no key of its model's)")
    names = set(kind.split())
    if state.get("description_allow_html", False) is not False:
        state["description_allow_html"] = False
        dropped.append(f"{what}:description_allow_html")
    if _renders(names, HTML_WIDGETS) and "value" in state:
        value = state["value"]
        cleaned = clean_html(value) if isinstance(value, str) else None
        if cleaned != value:
            dropped.append(f"{what}:value ({'sanitised' if cleaned is not None else 'removed'})")
            state["value"] = cleaned or ""
    if _renders(names, OUTPUT_WIDGETS) and "outputs" in state:
        state["outputs"] = outputs(state["outputs"], f"{what}.outputs", dropped)
    # an Output widget captures into itself the outputs of the request its msg_id names: only a box's request
    if state.get("msg_id") not in (None, "") and not (isinstance(state["msg_id"], str) and state["msg_id"] in requests):
        state["msg_id"] = ""
        dropped.append(f"{what}:msg_id (no request of the box's)")
    # an Image, Video or Audio view with format "url" loads its value (text or a buffer) as a URL, with no click:
    # no widget of the box's has it, whatever it is now (its view may become one of those in a later message)
    if isinstance(state.get("format"), str) and state["format"].strip().lower() == "url":
        del state["format"]
        dropped.append(f"{what}:format url")
    if _styled(kind):
        for key in [k for k, v in state.items() if k not in _COMMON and not _inert_css(v)]:
            del state[key]
            dropped.append(f"{what}:{str(key)[:40]} (CSS that may load a URL)")


def widget_buffers(kind: str, data: dict, buffers: list[bytes], what: str, dropped: list[str],
                   models: str | None = None) -> list[bytes]:
    """The binary buffers a widget comm message keeps: the frontend puts each into the state at its buffer path,
    unchecked, so one that would set a key the host checks (names, description_allow_html, format, outputs, msg_id,
    the value of an HTML widget, any key of a Style or Layout model) or one its model lacks is dropped, with its
    path."""
    paths = data.get("buffer_paths")
    if not isinstance(paths, list):
        return buffers
    kept_paths, kept = [], []
    for i, path in enumerate(paths):
        key = path[0] if isinstance(path, list) and path else None
        if not _buffer_key_ok(kind, key, models):
            dropped.append(f"{what}.buffer_paths:{str(key)[:40]}")
            continue
        kept_paths.append(path)
        if i < len(buffers):
            kept.append(buffers[i])
    data["buffer_paths"] = kept_paths
    return kept + buffers[len(paths):]


def _buffer_key_ok(kind: str, key: Any, models: str | None = None) -> bool:
    allowed = model_keys(kind if models is None else models)
    return isinstance(key, str) and key not in _CHECKED_KEYS and not _styled(kind) \
        and not (key == "value" and _renders(set(kind.split()), HTML_WIDGETS)) and (allowed is None or key in allowed)


def control_kind(entry: dict, known: str = "") -> str:
    """What a widget of the control comm's `update_states` is (with `known`, what its comm was before): its
    `model_name` and the names its state sets, as the frontend makes its model from the one, its view from the other."""
    return widget_kind(widget_kind(known, {"_model_name": entry.get("model_name")}), entry.get("state"))


def control_states(data: dict, buffers: list[bytes], what: str, dropped: list[str],
                   requests: Container[str] = (), comms: dict[str, str] | None = None) -> list[bytes]:
    """Sanitise, in place, the widget control comm's `update_states` (ipywidgets' answer to `request_states`, which
    the frontend loads every widget from on page load): each `states[id].state` as the comm_open of that widget
    would be, an entry that is no object with an object `state`, or one `refusal` refuses (a link), dropped, and of
    the buffers (`buffer_paths`, `[id, "state", key, ...]`) only those that set an unchecked key of a kept entry.
    An entry naming a widget the box has already (`comms`) is judged with what it was: the page may hold it and set
    this state on it, so it may not make it render markup it did not. The buffers kept are returned."""
    states = data.get("states")
    if not isinstance(states, dict):
        states = data["states"] = {}
        dropped.append(f"{what}.states")
    kinds: dict[str, str] = {}
    for model_id, entry in list(states.items()):
        why = refusal(entry["state"], entry) if isinstance(entry, dict) and isinstance(entry.get("state"), dict) \
            else "not a widget's state"
        known = (comms or {}).get(model_id, "")
        if why is None and known == REFUSED:
            why = "a comm refused before"
        elif why is None and known:
            before, after = set(known.split()), set(control_kind(entry, known).split())
            if any(_renders(after, k) and not _renders(before, k) for k in (HTML_WIDGETS, OUTPUT_WIDGETS)):
                why = "a widget that renders markup it did not"
        if why is not None:
            del states[model_id]
            dropped.append(f"{what}.states:{model_id[:40]} ({why})")
            continue
        kinds[model_id] = control_kind(entry, known)
        widget_state(kinds[model_id], entry["state"], f"{what}.states:{model_id[:40]}.state", dropped, requests)
    paths = data.get("buffer_paths", [])
    if not isinstance(paths, list):
        paths = []
        dropped.append(f"{what}.buffer_paths")
    kept_paths, kept = [], []
    for i, path in enumerate(paths):
        ok = (isinstance(path, list) and len(path) >= 3 and isinstance(path[0], str) and path[0] in kinds
              and path[1] == "state" and _buffer_key_ok(kinds[path[0]], path[2]))
        if not ok:
            dropped.append(f"{what}.buffer_paths:{str(path)[:60]}")
            continue
        kept_paths.append(path)
        if i < len(buffers):
            kept.append(buffers[i])
    if "buffer_paths" in data or kept_paths:
        data["buffer_paths"] = kept_paths
    return kept
