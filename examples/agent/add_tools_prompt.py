r"""Give every row of a verl-schema parquet the tools system prompt (Qwen2.5's `# Tools` block listing the tools of
an agent config), so the model knows which tools it may call and how to write a call.

    python examples/agent/add_tools_prompt.py --config examples/agent/geo3k_check_answer.yaml \
        --input ~/data/geo3k/train.parquet --output ~/data/geo3k_tools/train.parquet

The tools are read from the config's `agent.tools`. A row that already starts with a system message gets the tools
block appended to it; otherwise a system message is added. `--instruction` is appended after the tools block (e.g.
when to call which tool). Every other column is copied unchanged (images stay encoded bytes). The output is written
atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

DEFAULT_SYSTEM = "You are a helpful assistant."


def with_tools_prompt(prompt: list[dict], tools_prompt: str) -> list[dict]:
    r"""The chat messages of one row with the tools block in the system message.

    >>> with_tools_prompt([{"role": "user", "content": "q"}], "# Tools")[0]["content"]
    'You are a helpful assistant.\n\n# Tools'
    >>> with_tools_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], "# Tools")[0]
    {'role': 'system', 'content': 'Be brief.\n\n# Tools'}
    """
    messages = [dict(m) for m in prompt]
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages[0]["content"] = messages[0]["content"] + "\n\n" + tools_prompt
        return messages
    return [{"role": "system", "content": DEFAULT_SYSTEM + "\n\n" + tools_prompt}] + messages


def tools_prompt_of(config_file: str, instruction: str = "") -> str:
    """The tools block for the `agent.tools` of a run config (yaml)."""
    from omegaconf import OmegaConf

    from vlmrl.agent.config import AgentConfig
    from vlmrl.agent.tools import ToolRegistry

    section = OmegaConf.load(config_file).get("agent")
    if section is None or not section.get("tools"):
        raise SystemExit(f"{config_file} has no agent.tools")
    config: AgentConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AgentConfig), section))
    text = ToolRegistry.from_specs(config.tools).system_prompt()
    return text + ("\n\n" + instruction if instruction else "")


def convert(input_file: str, output_file: str, tools_prompt: str) -> int:
    """Rewrite the prompt column; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(input_file)
    if "prompt" not in table.column_names:
        raise SystemExit(f"{input_file} has no prompt column (columns: {table.column_names})")
    prompts = [with_tools_prompt(p, tools_prompt) for p in table.column("prompt").to_pylist()]
    index = table.column_names.index("prompt")
    table = table.set_column(index, "prompt", pa.array(prompts))
    out = Path(output_file).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return table.num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config (yaml) whose agent.tools to list")
    parser.add_argument("--input", required=True, help="verl-schema parquet")
    parser.add_argument("--output", required=True, help="where to write the parquet with the tools prompt")
    parser.add_argument("--instruction", default="", help="text after the tools block (when to call which tool)")
    args = parser.parse_args()
    rows = convert(args.input, args.output, tools_prompt_of(args.config, args.instruction))
    print(f"wrote {rows} rows to {args.output}")


if __name__ == "__main__":
    main()
