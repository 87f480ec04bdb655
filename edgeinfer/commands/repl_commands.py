"""The interactive `run`'s slash commands, as `ollama run` has them: /set, /show, /load, /save,
/clear, /bye, /? (help texts, parameter parsing and the /show texts live here)."""

from __future__ import annotations

import shlex

from edgeinfer.errors import EdgeInferError

def constraint_for_format(value: str):
    """`--format` / `/set format`: "json" (any JSON object) or a JSON-schema file's path."""
    from edgeinfer.prompt import grammar

    value = value.strip()
    if value == "json":
        return grammar.any_json()
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError as exc:
        raise EdgeInferError(f"format must be 'json' or a JSON schema file; cannot read {value!r}: "
                             f"{exc.strerror or exc}") from None
    return grammar.json_schema(text)


def constraint_for_grammar_file(path: str):
    """`--grammar-file FILE.gbnf`: a llama.cpp GBNF grammar."""
    from edgeinfer.prompt import grammar

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError as exc:
        raise EdgeInferError(f"cannot read grammar file {path!r}: {exc.strerror or exc}") from None
    return grammar.gbnf(text)


def constraint_from_args(args):
    """The constraint `run`'s --format / --grammar-file ask for, or None."""
    fmt, gfile = getattr(args, "format", None), getattr(args, "grammar_file", None)
    if fmt and gfile:
        raise EdgeInferError("give --format or --grammar-file, not both")
    if fmt:
        return constraint_for_format(fmt)
    return constraint_for_grammar_file(gfile) if gfile else None


# `/set parameter` names (Ollama's) -> (SamplingParams field, value type, help).
PARAMETERS = {
    "seed": ("seed", int, "Random number seed"),
    "num_predict": ("max_tokens", int, "Max number of tokens to predict (-1 = until the context is full)"),
    "top_k": ("top_k", int, "Pick from top k num of tokens"),
    "top_p": ("top_p", float, "Pick token based on sum of probabilities"),
    "min_p": ("min_p", float, "Pick token based on top token probability * min_p"),
    "temperature": ("temperature", float, "Set creativity level"),
    "repeat_penalty": ("repeat_penalty", float, "How strongly to penalize repetitions"),
    "repeat_last_n": ("repeat_last_n", int, "Set how far back to look for repetitions"),
    "presence_penalty": ("presence_penalty", float, "Penalize tokens already present"),
    "frequency_penalty": ("frequency_penalty", float, "Penalize tokens by how often they appeared"),
    "stop": ("stop", str, "Set the stop parameters"),
}
# Ollama parameters fixed when the model loads here: say how to change them instead.
LOAD_TIME = {"num_ctx": "-c/--ctx-size N", "num_gpu": "-ngl/--gpu-layers N", "num_thread": "-t/--threads N"}

USAGE = '''Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a model (or a saved session)
  /image <path>   Attach an image to the next message
  /save <name>    Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use """ to begin a multi-line message.
An image file's path in a message (/..., ./..., ~/...) attaches it, for a model with an mmproj.'''

USAGE_SET = '''Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set format json       Enable JSON mode (or a FILE.schema.json: answers follow the schema)
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats'''

USAGE_SHOW = '''Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template'''

USAGE_SHORTCUTS = '''Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
   Alt + b            Move back (left) one word
   Alt + f            Move forward (right) one word
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor
  Up / Down           Previous / next line of the history
  Ctrl + r            Search the history

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit (/bye)'''


def usage_parameters() -> str:
    rows = [f"  /set parameter {name} <{kind.__name__ if name != 'stop' else 'string> <string> ...'}>"
            for name, (_, kind, _) in PARAMETERS.items()]
    width = max(len(r) for r in rows) + 2
    lines = [f"{row:<{width}}{PARAMETERS[name][2]}" for row, name in zip(rows, PARAMETERS)]
    return "Parameters:\n" + "\n".join(lines)


def help_text(topic: str) -> str:
    """`/?` and `/help`, with an optional topic (set, show, shortcuts, parameters)."""
    topic = topic.strip().lstrip("/")
    if not topic:
        return USAGE
    if topic in ("shortcut", "shortcuts"):
        return USAGE_SHORTCUTS
    if topic == "set":
        return USAGE_SET
    if topic == "show":
        return USAGE_SHOW
    if topic in ("parameter", "parameters"):
        return usage_parameters()
    raise EdgeInferError(f"unknown help topic {topic!r} (try /? set, /? show, /? shortcuts)")


def split_words(text: str) -> list[str]:
    """Words as a shell splits them, so `"<|end|>" "###"` are two words without their quotes."""
    try:
        return shlex.split(text)
    except ValueError as exc:  # an unclosed quote
        raise EdgeInferError(f"cannot parse {text.strip()!r}: {exc}") from None


def set_parameter(params: dict, text: str) -> str:
    """Apply `/set parameter NAME VALUE...` to `params` (checked before anything changes);
    returns the confirmation line."""
    from edgeinfer.sampling import SamplingParams

    words = split_words(text)
    if not words:
        return usage_parameters()
    name, values = words[0], words[1:]
    if name in LOAD_TIME:
        raise EdgeInferError(f"{name} is fixed when the model loads: restart with {LOAD_TIME[name]}")
    if name not in PARAMETERS:
        raise EdgeInferError(f"unknown parameter {name!r} (known: {', '.join(sorted(PARAMETERS))})")
    field, kind, _ = PARAMETERS[name]
    if not values:
        raise EdgeInferError(f"usage: /set parameter {name} <{kind.__name__}>")
    if field == "stop":
        value = values  # as Ollama: the given strings replace the stop list
    else:
        if len(values) != 1:
            raise EdgeInferError(f"{name} takes one value, got {len(values)}")
        try:
            value = kind(values[0])
        except ValueError:
            kind_name = "whole number" if kind is int else "number"
            raise EdgeInferError(f"{name} needs a {kind_name}, got {values[0]!r}") from None
    trial = {**params, field: value}
    try:
        SamplingParams(**trial).validate()
    except EdgeInferError as exc:
        raise EdgeInferError(str(exc).replace(field, name, 1) if field != name else str(exc)) from None
    params.update(trial)
    return f"Set parameter '{name}' to '{', '.join(values)}'"


def parameter_lines(params: dict) -> list[str]:
    """`name value` lines of the current parameters, in Ollama's names (unset seed omitted)."""
    lines = []
    for name, (field, _, _) in PARAMETERS.items():
        value = params.get(field)
        if field == "stop":
            lines += [f"{name:<20}{_quote(s)}" for s in value or []]
        elif value is not None:
            lines.append(f"{name:<20}{value}")
    return lines


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def show_info(model) -> str:
    """The model facts `ollama show` leads with."""
    from edgeinfer.model_info import describe, human_count

    info = describe(model.engine.model_file)
    rows = [("architecture", info.architecture), ("parameters", human_count(info.parameters)),
            ("context length", info.context_length), ("embedding length", info.embedding_length),
            ("quantization", info.quantization), ("context in use", model.n_ctx),
            ("chat template", "from the file" if info.has_chat_template else "none in the file")]
    return "  Model\n" + "\n".join(f"    {k:<20}{v}" for k, v in rows)


def _license(model) -> str | None:
    from edgeinfer.metadata import meta_str

    return meta_str(model.engine.model_file.gguf.metadata, "general.license", None)


def show_license(model) -> str:
    lic = _license(model)
    return str(lic) if lic else "No license was specified for this model."


def show_template(model, raw: bool) -> str:
    if raw:
        return "No prompt template: this model runs as plain completion (--chat-template NAME to chat)."
    return model.template.source.rstrip("\n")


def show_modelfile(model, params: dict, system: str | None, raw: bool) -> str:
    """An Ollama Modelfile describing this session."""
    lines = ['# Modelfile generated by "edgeinfer run"', f"FROM {model.path}", ""]
    if not raw:
        lines += [f'TEMPLATE """{model.template.source}"""', ""]
    if system:
        lines += [f'SYSTEM """{system}"""', ""]
    lines += [f"PARAMETER {line}" for line in parameter_lines(params)]
    lic = _license(model)
    if lic:
        lines += ["", f'LICENSE """{lic}"""']
    return "\n".join(lines).rstrip("\n")


def show(topic: str, model, params: dict, system: str | None, raw: bool) -> str:
    """`/show TOPIC` as text."""
    topic = topic.strip()
    if not topic:
        return USAGE_SHOW
    if topic == "info":
        return show_info(model)
    if topic == "parameters":
        lines = parameter_lines(params)
        return "Parameters:\n" + "\n".join(f"  {line}" for line in lines)
    if topic == "system":
        return system if system else "No system message was specified for this model."
    if topic == "template":
        return show_template(model, raw)
    if topic == "license":
        return show_license(model)
    if topic == "modelfile":
        return show_modelfile(model, params, system, raw)
    raise EdgeInferError(f"unknown /show topic {topic!r} (info, license, modelfile, parameters, system, template)")


def parse_system(text: str) -> str:
    """`/set system TEXT`: the text, without one pair of surrounding quotes."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text
