"""The python grader's subprocess: no network, no files outside its folder, no processes; code given as source;
a missing file refused at submit. And the score_model grader's local judge."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from jobs.errors import JobSpecError
from jobs.objectives.graders import Graders
from jobs.objectives.graders.sandbox import network_namespace, run_python_grader
from jobs.spec.llm import GRPOSpec
from tests.jobs.objectives.test_graders import ROW, load_grader, write

NETWORK = """
import socket
def grade(sample, item):
    socket.create_connection(("127.0.0.1", int(item["port"])), timeout=2).close()
    return 1.0
"""


@pytest.fixture
def listening() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    yield server.getsockname()[1]
    server.close()


def python_grader(path: Path, **options: object) -> GRPOSpec:
    return GRPOSpec.model_validate({"grader": {"type": "python", "file": str(path), **options}}).grader


@pytest.mark.parametrize("isolate_network", [False, True])
def test_a_grader_reaches_no_network(tmp_path: Path, listening: int, isolate_network: bool) -> None:
    """False: the audit hook alone refuses the socket; True: the network namespace too, where one can be made."""
    if isolate_network and not network_namespace():
        pytest.skip("unshare cannot make a network namespace here")
    path = write(tmp_path, NETWORK)
    spec = python_grader(path)
    [result] = run_python_grader(
        spec, path, [{"output_text": "x"}], [{"port": listening}], isolate_network=isolate_network
    )
    assert isinstance(result, RuntimeError) and "PermissionError" in str(result), result


def test_without_the_hook_the_same_grader_connects(tmp_path: Path, listening: int) -> None:
    """The control of the test above: the connection it refuses does succeed from an unguarded process."""
    import subprocess
    import sys

    path = write(tmp_path, NETWORK + f"\nprint(grade({{}}, {{'port': {listening}}}))\n")
    assert subprocess.run([sys.executable, str(path)], capture_output=True, text=True).stdout.strip() == "1.0"


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ("open('/etc/hostname').read()", "may read only its folder"),
        ("open(os.path.join(os.path.dirname(os.getcwd()), 'escaped.txt'), 'w').write('x')", "may write only"),
        ("os.listdir('/')", "may list only its folder"),
        ("os.remove('/tmp/nothing-to-remove')", "may change files only in its folder"),
        ("subprocess.run(['true'])", "no network, no processes"),
        ("os.system('true')", "no network, no processes"),
    ],
)
def test_a_grader_touches_nothing_outside_its_folder(tmp_path: Path, body: str, refusal: str) -> None:
    path = write(tmp_path, f"import os, subprocess\ndef grade(sample, item):\n    {body}\n    return 1.0\n")
    grade = Graders(python_grader(path))
    assert grade(["a"], [ROW]) == [0.0]
    assert len(grade.errors) == 1 and refusal in grade.errors[0], grade.errors
    assert not (tmp_path / "escaped.txt").exists()


def test_a_grader_reads_and_writes_in_its_folder_and_imports_beside_it(tmp_path: Path) -> None:
    (tmp_path / "grader").mkdir()
    (tmp_path / "grader" / "answers.txt").write_text("4")
    (tmp_path / "grader" / "helper.py").write_text("def clean(text):\n    return text.strip()\n")
    path = write(
        tmp_path,
        "import json, helper\n"
        "def grade(sample, item):\n"
        "    open('seen.txt', 'a').write(sample['output_text'])\n"
        "    print('a grader may print')\n"
        "    return float(helper.clean(sample['output_text']) == open('answers.txt').read())\n",
    )
    assert Graders(python_grader(path))([" 4 ", "5"], [ROW, ROW]) == [1.0, 0.0]
    assert (tmp_path / "grader" / "seen.txt").read_text() == " 4 5"


def test_a_grader_given_as_source_runs_in_a_folder_of_its_own() -> None:
    spec = GRPOSpec.model_validate(
        {
            "grader": {
                "type": "python",
                "source": "import os\ndef grade(sample, item):\n"
                "    return float(sample['output_text'] == item['answer']) + len(os.listdir('.'))\n",
            }
        }
    ).grader
    assert Graders(spec)(["4", "5"], [ROW, ROW]) == [2.0, 1.0]  # its folder holds only grader.py


def test_a_grader_source_that_does_not_compile_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match=r"training\.grpo\.grader\.source.*not valid Python: line 1"):
        load_grader(tmp_path, {"type": "python", "source": "def grade(:"})


def test_a_missing_grader_file_is_refused_at_submit(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match=r"training\.grpo\.grader\.file.*does not exist"):
        load_grader(tmp_path, {"type": "python", "file": "graders/missing.py"})
    with pytest.raises(JobSpecError, match="give exactly one of file"):
        load_grader(tmp_path, {"type": "python"})


def save_judge(directory: Path, token: str) -> Path:
    """A tiny Llama that answers ``token`` whatever it is asked: every layer's output zeroed and every embedding
    equal, so the last hidden state is one constant vector, and only ``token``'s output row points along it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.jobs.llm_helpers import save_bpe_tokenizer, save_llama

    save_llama(directory)
    save_bpe_tokenizer(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids(token)] = 1.0
    model.save_pretrained(directory)
    return directory


def test_score_model_reads_a_local_judges_number_clipped_to_its_range(tmp_path: Path) -> None:
    save_judge(tmp_path / "models" / "judge", "7")
    judge = {
        "type": "score_model",
        "model": "judge",
        "input": [{"role": "user", "content": "Score 0 to 10: {{sample.output_text}} (answer {{item.answer}})"}],
        "max_new_tokens": 1,
    }
    assert Graders(load_grader(tmp_path, {**judge, "range": [0, 10]}))(["4"], [ROW]) == [7.0]
    assert Graders(load_grader(tmp_path, judge))(["4"], [ROW]) == [1.0]  # range [0, 1]: 7 clipped to 1


def test_score_model_needs_a_model_under_a_model_root(tmp_path: Path) -> None:
    judge = {"type": "score_model", "model": "gpt-4o", "input": [{"role": "user", "content": "score it"}]}
    with pytest.raises(JobSpecError, match=r"training\.grpo\.grader\.model.*'gpt-4o' does not exist"):
        load_grader(tmp_path, judge)


def test_the_network_namespace_itself_has_no_route(listening: int) -> None:
    """The kernel's guarantee, without the audit hook: a process in the namespace cannot reach the host's port."""
    import subprocess
    import sys

    prefix = network_namespace()
    if not prefix:
        pytest.skip("unshare cannot make a network namespace here")
    connect = f"import socket; socket.create_connection(('127.0.0.1', {listening}), timeout=2)"
    done = subprocess.run([*prefix, sys.executable, "-c", connect], capture_output=True, text=True)
    assert done.returncode != 0 and ("unreachable" in done.stderr.lower() or "refused" in done.stderr.lower())
