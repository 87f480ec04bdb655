"""The sandbox chat templates render in: Jinja2 that runs a model file's code under a budget.

ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, the `loopcontrols`
extension, HF's `tojson`, `raise_exception`, `strftime_now` and the `{% generation %}` tag.
A template is code from the model file, so each render runs under a budget (the MAX_*
constants below): a deadline and the caller's `cancel` Event, checked on every loop
iteration, call and filter; a cap on the output, counted as it is generated; and size
checks before anything that can build a large value (`*`, `**`, `+`, `%`, `~`, range(),
str methods, filters, printing). Past it: TemplateBudgetError / TemplateCancelled.
Operators and filters that could be large are never folded into constants at compile time.

    template = compile_template(source, "model")
    text = render_budgeted(template, {"messages": [...]}, "model", cancel=None)

edgeinfer.prompt.chat_template builds the context HF's apply_chat_template passes and the built-ins.
"""

from __future__ import annotations

import json
import re
import string
import threading
import time
import types
from collections.abc import ItemsView, KeysView, ValuesView
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, pass_context

from edgeinfer.errors import TemplateError

# The render budget: a template is code from the model file, so one render may take at
# most this long and build at most this much, whichever comes first.
MAX_RENDER_S = 2.0               # wall time of one render (also checked against `cancel`)
MAX_OUTPUT_CHARS = 8 << 20       # the rendered prompt (a request body is at most 2 MiB)
MAX_VALUE_CHARS = 8 << 20        # one string, list or printed value the template builds
MAX_WORK_CHARS = 64 << 20        # everything built along the way, all values and output together
MAX_RANGE = 100_000              # items in one range()
MAX_INT_BITS = 1 << 16           # integers built by * and **
MAX_SOURCE_CHARS = 1 << 20       # the template source itself
_CHECK_EVERY = 64                # loop iterations between clock/cancel checks

class TemplateBudgetError(TemplateError):
    """A render that ran past its time, output or memory budget."""


class TemplateCancelled(TemplateError):
    """A render stopped because its request was cancelled (timeout, client gone)."""


# -- the budget of one render ---------------------------------------------------------------

class _Budget:
    """Deadline, cancel flag and characters built so far, for the render on this thread."""

    __slots__ = ("deadline", "cancel", "work", "ticks")

    def __init__(self, cancel: threading.Event | None) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_S
        self.cancel = cancel
        self.work = 0
        self.ticks = 0

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TemplateCancelled("was cancelled")
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"exceeded its {MAX_RENDER_S:g} s render budget")

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0:
            self.check()

    def allow(self, n: int, what: str) -> None:
        """Refuse, before building it, a value of `n` characters or items."""
        if n > MAX_VALUE_CHARS:
            amount = f"more than {MAX_VALUE_CHARS}" if n == MAX_VALUE_CHARS + 1 else _amount(n)
            raise TemplateBudgetError(f"exceeded its memory budget: {what} would build {amount} "
                                      f"characters or items (limit {MAX_VALUE_CHARS})")
        if self.work + n > MAX_WORK_CHARS:
            raise TemplateBudgetError(f"exceeded its memory budget: {what} would take it past "
                                      f"{MAX_WORK_CHARS} characters built")

    def charge(self, n: int) -> None:
        self.work += n
        if self.work > MAX_WORK_CHARS:
            raise TemplateBudgetError(f"exceeded its memory budget: it built more than "
                                      f"{MAX_WORK_CHARS} characters")

    def charge_value(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            n = len(value)
            if n > MAX_VALUE_CHARS:
                self.allow(n, "a value")
            self.charge(n)
        return value


class _Active(threading.local):
    budget: _Budget | None = None


_active = _Active()


def _amount(n: int) -> str:
    return str(n) if n < 10 ** 30 else f"about 10**{len(str(n)) - 1}" if n < 1 << 4096 else "astronomically many"


class _TooBig(Exception):
    pass


def _size(obj: Any, limit: int = MAX_VALUE_CHARS) -> int:
    """About how many characters str(obj) or tojson(obj) comes to (shared parts counted
    each time they print); raises _TooBig as soon as that passes `limit`."""
    if isinstance(obj, (str, bytes)):
        return len(obj)
    memo: dict[int, int] = {}

    def walk(o: Any) -> int:
        if isinstance(o, (str, bytes)):
            return len(o) + 2
        if o is None or isinstance(o, (bool, int, float)):
            return 24
        key = id(o)
        got = memo.get(key)
        if got is not None:
            return got
        if isinstance(o, Namespace):
            o = object.__getattribute__(o, "_Namespace__attrs")
        if isinstance(o, Mapping):
            items: Any = (x for kv in o.items() for x in kv)
        elif isinstance(o, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            items = o
        else:
            return 64  # other objects print a short repr
        memo[key] = 0  # a cycle prints as '...'
        total = 2
        for x in items:
            total += walk(x) + 2
            if total > limit:
                raise _TooBig
        memo[key] = total
        return total

    try:
        return walk(obj)
    except RecursionError:
        raise TemplateBudgetError("exceeded its memory budget: a value is nested too deeply") from None


def _allow_printed(b: _Budget, values: Sequence[Any], what: str) -> int:
    """Check that printing `values` stays in budget; returns the characters it makes."""
    total = 0
    for v in values:
        try:
            total += _size(v, MAX_VALUE_CHARS - total)
        except _TooBig:
            total = MAX_VALUE_CHARS + 1
        b.allow(total, what)
    return total


def _budget_range(*args: Any) -> "_BudgetRange":
    rng = range(*args)
    try:
        n = len(rng)
    except OverflowError:
        n = None
    if n is None or n > MAX_RANGE:
        raise TemplateBudgetError(f"exceeded its loop budget: range({', '.join(map(str, args))}) has "
                                  f"more than {MAX_RANGE} items")
    return _BudgetRange(rng)


class _BudgetRange:
    """range() for templates: at most MAX_RANGE items, each iteration counted against the clock."""

    __slots__ = ("_r",)

    def __init__(self, r: range) -> None:
        self._r = r

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        got = self._r[i]
        return _BudgetRange(got) if isinstance(got, range) else got

    def __iter__(self) -> Iterator[int]:
        return _ticking(self._r)

    def __reversed__(self) -> Iterator[int]:
        return _ticking(reversed(self._r))

    def __contains__(self, x: Any) -> bool:
        return x in self._r

    def __eq__(self, other: Any) -> bool:
        return self._r == (other._r if isinstance(other, _BudgetRange) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._r)


def _ticking(iterable: Any) -> Iterator[Any]:
    b = _active.budget
    if b is None:
        yield from iterable
        return
    for x in iterable:
        b.tick()
        yield x


# -- size checks before an operation builds its result ------------------------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")


def _check_percent(b: _Budget, fmt: str | bytes, args: Any, what: str) -> None:
    """`fmt % args`: widths and precisions must fit the budget, '*' widths are refused."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    total, fields = len(text), 0
    for m in _PERCENT_SPEC.finditer(text):
        width, precision, _conv = m.groups()
        if width == "*" or precision == "*":
            raise TemplateBudgetError(f"exceeded its memory budget: {what} uses a '*' width")
        total += int(width or 0) + int(precision or 0)
        fields += 1
        b.allow(total, what)
    items = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    per_field = _allow_printed(b, items, what) if items else 0
    b.allow(total + fields * per_field, what)


def _check_str_format(b: _Budget, fmt: str, args: tuple, kwargs: dict) -> None:
    """str.format: each field's width/precision and the printed arguments fit the budget."""
    total, fields = len(fmt), 0
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _literal, field, spec, _conv in parsed:
        if field is None:
            continue
        fields += 1
        if spec and "{" in spec:
            raise TemplateBudgetError("exceeded its memory budget: str.format with a computed width")
        total += sum(int(d) for d in re.findall(r"\d+", spec or ""))
        b.allow(total, "str.format")
    printed = _allow_printed(b, list(args) + list(kwargs.values()), "str.format")
    b.allow(total + fields * printed, "str.format")


def _is_text(x: Any) -> bool:
    return isinstance(x, (str, bytes))


def _check_binop(b: _Budget, op: str, left: Any, right: Any) -> None:
    what = f"the {op!r} operator"
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateBudgetError(f"exceeded its memory budget: {what} would build an "
                                          f"integer of more than {MAX_INT_BITS} bits")
            return
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
            b.allow(len(seq) * max(times, 0), what)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right > MAX_INT_BITS or right * left.bit_length() > MAX_INT_BITS:
                raise TemplateBudgetError(f"exceeded its memory budget: {what} would build an "
                                          f"integer of more than {MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
            b.allow(len(left) + len(right), what)
    elif op == "%" and _is_text(left):
        _check_percent(b, left, right, what)


# str/bytes methods whose result can be much larger than their inputs
def _check_method(b: _Budget, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Checks a builtin method call before it runs; returns (possibly materialized) args."""
    name = getattr(obj, "__name__", "")
    what = f"{name}()"
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_VALUE_CHARS:
            raise TemplateBudgetError(f"exceeded its memory budget: {what} with the argument "
                                      f"{_amount(abs(a))} (limit {MAX_VALUE_CHARS})")
    owner = getattr(obj, "__self__", None)
    if not _is_text(owner):
        return args
    if name == "join" and args:
        items = list(args[0])
        _allow_printed(b, items, what)
        b.allow(len(owner) * max(len(items) - 1, 0) + sum(len(x) for x in items if _is_text(x)), what)
        return (items,) + args[1:]
    if name == "replace" and len(args) >= 2 and _is_text(args[0]) and _is_text(args[1]):
        old, new = args[0], args[1]
        hits = owner.count(old) if old else len(owner) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            hits = min(hits, args[2])
        b.allow(len(owner) + hits * max(len(new) - len(old), 0), what)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            b.allow(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0), what)
    elif name == "translate" and args:
        table = args[0]
        longest = max((len(v) for v in table.values() if _is_text(v)), default=1) if isinstance(table, Mapping) else 1
        b.allow(len(owner) * max(longest, 1), what)
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        b.allow(max(len(owner), args[0]), what)
    return args


# filters whose output can outgrow their input even with default arguments
_GROWING_FILTERS = frozenset({"center", "indent", "wordwrap", "tojson", "pprint", "urlize", "xmlattr"})


def _check_filter(b: _Budget, name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """Checks a filter call before it runs; returns the (possibly materialized) value."""
    if not args and not kwargs and isinstance(value, str) and name not in _GROWING_FILTERS:
        return value  # trim, upper, length...: nothing larger than what exists already
    what = f"the {name!r} filter"
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_VALUE_CHARS:
            raise TemplateBudgetError(f"exceeded its memory budget: {what} with the argument "
                                      f"{_amount(abs(a))} (limit {MAX_VALUE_CHARS})")
    if name == "join" and not isinstance(value, (list, tuple, str)):
        value = list(value)  # a generator: measure what it yields before joining
    printed = _allow_printed(b, [value, *args, *kwargs.values()], what)
    text = value if isinstance(value, str) else ""
    if name == "center" and args and isinstance(args[0], int):
        b.allow(max(printed, args[0]), what)
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        b.allow(printed + (text.count("\n") + 1) * max(pad, 0), what)
    elif name == "wordwrap":
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring")
        b.allow(printed * (1 + (len(wrap) if isinstance(wrap, str) else 1)), what)
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = text.count(old) if old else len(text) + 1
        b.allow(printed + hits * max(len(new) - len(old), 0), what)
    elif name == "format":
        _check_percent(b, text, kwargs or args, what)
    elif name == "join":
        sep = args[0] if args else kwargs.get("d", "")
        b.allow(printed + len(str(sep)) * max(len(value) - 1, 0), what)
    elif name == "sum":
        start = args[1] if len(args) > 1 else kwargs.get("start", 0)
        if not isinstance(start, (int, float)):
            raise TemplateBudgetError(f"exceeded its memory budget: {what} only adds numbers here")
    elif name in ("tojson", "pprint"):
        b.allow(printed * 2, what)
    return value


def _budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` with the budget checked before and its result counted after.

    pass_context also keeps Jinja from running the filter at compile time (constant
    folding), where no budget is active."""
    pass_arg = _PassArg.from_obj(func)

    @pass_context
    def wrapper(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        b = _active.budget
        if b is not None:
            b.tick()
            value = _check_filter(b, name, value, args, kwargs)
        if pass_arg is _PassArg.context:
            result = func(context, value, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        return b.charge_value(result) if b is not None else result

    wrapper.__name__ = getattr(func, "__name__", name)
    return wrapper


# -- the compiled template's hooks -------------------------------------------------------------

class _BudgetCodeGenerator(CodeGenerator):
    """Jinja's code generator, plus budget hooks: loops tick, `~` is measured, literal
    text written into buffers (macros, {% set %} blocks) is counted."""

    _budget_buffered = False
    _budget_iters: frozenset[int] = frozenset()  # ids of {% for %} iterables to wrap

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        self._budget_iters = self._budget_iters | {id(node.iter)}
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._budget_iters:
            return super().visit(node, *args, **kwargs)
        # a loop's iterable: each iteration counts against the clock
        self._budget_iters = self._budget_iters - {id(node)}
        self.write("environment.budget_iter(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.budget_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Output(self, node: nodes.Output, frame: Any) -> None:
        saved, self._budget_buffered = self._budget_buffered, frame.buffer is not None
        try:
            super().visit_Output(node, frame)
        finally:
            self._budget_buffered = saved

    def _output_const_repr(self, group: Any) -> str:
        src = super()._output_const_repr(group)
        # top-level text is counted as render() receives it; buffered text is not seen there
        return f"environment.budget_const({src})" if self._budget_buffered else src


_SMALL_NUMBER_OPS = frozenset({"+", "%"})
_NUMBERS = frozenset({int, float, bool})


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every way to build something big checked against the render budget."""

    code_generator_class = _BudgetCodeGenerator
    # intercepted operators are also never evaluated at compile time
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _active.budget
        if b is None:
            return self.binop_table[operator](left, right)
        if operator == "+" and type(left) is str and type(right) is str:
            # the common case (templates glue text with +), kept cheap: inline checks
            n = len(left) + len(right)
            b.work += n
            if n > MAX_VALUE_CHARS or b.work > MAX_WORK_CHARS:
                b.work -= n
                b.allow(n, "the '+' operator")
            return left + right
        if operator in _SMALL_NUMBER_OPS and type(left) in _NUMBERS and type(right) in _NUMBERS:
            return self.binop_table[operator](left, right)  # loop.index0 % 2: nothing grows
        b.tick()
        _check_binop(b, operator, left, right)
        return b.charge_value(self.binop_table[operator](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _active.budget
        if b is None:
            return super().call(__context, __obj, *args, **kwargs)
        b.check()  # every call: macros that recurse, methods in loops
        if isinstance(__obj, types.BuiltinMethodType):
            args = _check_method(b, __obj, args, kwargs)
        return b.charge_value(super().call(__context, __obj, *args, **kwargs))

    def getitem(self, obj: Any, argument: Any) -> Any:
        if type(argument) is not slice:
            if type(obj) is dict and type(argument) is str and argument in obj:
                return obj[argument]  # message['role']: what the sandbox would return, sooner
            return super().getitem(obj, argument)
        value = super().getitem(obj, argument)
        b = _active.budget
        return b.charge_value(value) if b is not None else value

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            b = _active.budget
            if b is None:
                return wrapped(*args, **kwargs)
            items = args[0] if value.__name__ == "format_map" and args else None
            if isinstance(items, Mapping):
                _check_str_format(b, fmt, (), dict(items))
            else:
                _check_str_format(b, fmt, args, kwargs)
            return b.charge_value(wrapped(*args, **kwargs))

        return checked

    # called from the generated code (see _BudgetCodeGenerator) ------------------------------
    def budget_iter(self, iterable: Any) -> Any:
        if isinstance(iterable, _BudgetRange) or _active.budget is None:
            return iterable
        return _ticking(iterable)

    def budget_concat(self, values: tuple) -> str:
        b = _active.budget
        if b is not None:
            b.tick()
            b.allow(_allow_printed(b, values, "the '~' operator"), "the '~' operator")
        text = "".join(map(str, values))
        return b.charge_value(text) if b is not None else text

    def budget_const(self, text: str) -> str:
        b = _active.budget
        if b is not None:
            b.charge(len(text))
        return text


def _finalize(value: Any) -> str:
    """Every {{ expression }}: printed only once its size is known to fit."""
    b = _active.budget
    if b is None:
        return value if isinstance(value, str) else str(value)
    if not isinstance(value, str):
        _allow_printed(b, (value,), "printing a value")
        value = str(value)
    b.charge(len(value))
    return value


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text; render it as-is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _RaisedByTemplate(Exception):
    """raise_exception() from inside a template; becomes TemplateError with its message."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: no HTML escaping, unicode kept (jinja's own filter escapes < > & ').
    b = _active.budget
    if b is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)
    if isinstance(indent, str) and len(indent) > 16 or isinstance(indent, int) and indent > 16:
        raise TemplateBudgetError("exceeded its memory budget: tojson indent is over 16")
    if separators is not None and sum(len(s) for s in separators if isinstance(s, str)) > 16:
        raise TemplateBudgetError("exceeded its memory budget: tojson separators are over 16 characters")
    # pieces are counted as the encoder makes them (indentation can grow with depth)
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    parts, n = [], 0
    for part in encoder.iterencode(x):
        n += len(part)
        if n > MAX_VALUE_CHARS:
            b.allow(n, "the 'tojson' filter")
        parts.append(part)
    return "".join(parts)


def _strftime_now(fmt: str) -> str:
    b = _active.budget
    if b is not None and isinstance(fmt, str):
        b.allow(len(fmt) * 16, "strftime_now()")  # no directive prints more than ~16x its length
    return datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    from jinja2.utils import generate_lorem_ipsum

    if not (isinstance(n, int) and isinstance(max, int)) or n * max > 100_000:
        raise TemplateBudgetError("exceeded its memory budget: lipsum() asks for too much text")
    return generate_lorem_ipsum(n, html, min, max)


@lru_cache(maxsize=1)
def _environment() -> _BudgetedEnvironment:
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                               extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.globals["range"] = _budget_range
    env.globals["lipsum"] = _lipsum
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _template_line(exc: BaseException) -> int | None:
    """The template line a render error came from (jinja rewrites tracebacks to it)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def compile_template(source: str, name: str) -> jinja2.Template:
    """`source` compiled in the sandbox; a one-line TemplateError naming `name` if it is too
    long, malformed or nested too deeply to compile."""
    if len(source) > MAX_SOURCE_CHARS:
        raise TemplateError(f"chat template {name} is {len(source)} characters long; "
                            f"the limit is {MAX_SOURCE_CHARS}")
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template {name}: syntax error at line {exc.lineno}: "
                            f"{exc.message}") from None
    except (RecursionError, MemoryError, SyntaxError, SystemError, ValueError) as exc:
        # nesting too deep for Jinja's parser or Python's compiler
        raise TemplateError(f"chat template {name} cannot be compiled: "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from None


def render_budgeted(template: jinja2.Template, context: Mapping[str, Any], name: str,
                    cancel: threading.Event | None = None) -> str:
    """`template` rendered with `context` under the render budget (MAX_RENDER_S,
    MAX_OUTPUT_CHARS, MAX_WORK_CHARS): past it, TemplateBudgetError; once `cancel` is set,
    TemplateCancelled; any other failure a one-line TemplateError (with the template line)."""
    budget = _Budget(cancel)
    outer, _active.budget = _active.budget, budget
    chunks = template.generate(**context)
    try:
        budget.check()
        parts: list[str] = []
        size = 0
        for chunk in chunks:  # the output is counted as it comes, never built past the limit
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateBudgetError(f"exceeded its output budget of {MAX_OUTPUT_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    except (TemplateBudgetError, TemplateCancelled) as exc:
        line = _template_line(exc)
        where = f" (line {line})" if line else ""
        raise type(exc)(f"chat template {name} {exc}{where}") from None
    except _RaisedByTemplate as exc:
        raise TemplateError(f"chat template {name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure inside user-supplied Jinja
        line = _template_line(exc)
        where = f" at line {line}" if line else ""
        raise TemplateError(f"chat template {name}{where}: {type(exc).__name__}: "
                            f"{str(exc)[:300]}") from None
    finally:
        chunks.close()
        _active.budget = outer
