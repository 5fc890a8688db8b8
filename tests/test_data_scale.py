"""Training data at scale: regeneration through a real `transformers serve` on 127.0.0.1,
data preparation shared by the processes of a launch, and datasets in the hub layout.

The server tests start `transformers serve` with the tiny target (a subprocess, loopback
only, nothing downloaded) and check its rows against in-process greedy regeneration, which
they must equal at temperature 0: same prompts, same stop tokens, same text."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import draftsmith.data.regen_server as regen_server
from draftsmith.cli import main
from draftsmith.data.conversations import load_conversations
from draftsmith.data.corpus import load_embedded_corpus
from draftsmith.data.feature_cache import write_feature_cache
from draftsmith.data.local_server import LocalServer, free_port
from draftsmith.data.regen_server import decoding_for, regenerate_via_servers
from draftsmith.data.regenerate import embedded_conversations, regenerate
from draftsmith.data.reply_decoding import ReplyDecoding
from draftsmith.data.server_endpoint import Limits
from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.errors import DraftsmithError
from draftsmith.models.target import build_tiny_target, load_target
from draftsmith.processes import Processes
from test_regenerate import CONVERSATIONS as REGEN_CONVERSATIONS

# test_regenerate's conversations, one more so that a stopped server leaves rows on both sides.
CONVERSATIONS = [*REGEN_CONVERSATIONS, [{"role": "user", "content": "while True:"}]]
NEW_TOKENS = 8


# ---------------------------------------------------------------- the tiny target and its server

@pytest.fixture(scope="module")
def corpus_target_dir(tmp_path_factory):
    tokenizer = train_tokenizer(load_embedded_corpus("train", max_chars=150_000), vocab_size=512)
    model = build_tiny_target(vocab_size=len(tokenizer), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1)
    folder = tmp_path_factory.mktemp("target") / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus_target(corpus_target_dir):
    return load_target(corpus_target_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(corpus_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(corpus_target_dir))


@pytest.fixture(scope="module")
def server(corpus_target_dir, tmp_path_factory):
    with LocalServer(corpus_target_dir, tmp_path_factory.mktemp("serve") / "serve.log", threads=1) as running:
        yield running


def read(path):
    return [json.loads(line)["messages"] for line in Path(path).read_text().splitlines()]


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def greedy_in_process(target, tokenizer, conversations, out, untemplated=False):
    return read(regenerate(target, tokenizer, conversations, out, ReplyDecoding(max_new_tokens=NEW_TOKENS),
                           batch_size=4, untemplated=untemplated))


def fast_limits(**extra) -> Limits:
    return Limits(**{"in_flight": 2, "timeout": 60.0, "retries": 1, **extra})


# ---------------------------------------------------------------- through the server

def test_the_server_path_writes_the_in_process_greedy_rows(server, corpus_target_dir, corpus_target, tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", CONVERSATIONS)
    assert main(["data", "regenerate", "--target", str(corpus_target_dir), "--dataset", str(data), "--server", server.url,
                 "--out", str(tmp_path / "served.jsonl"), "--temperature", "0",
                 "--max-new-tokens", str(NEW_TOKENS), "--in-flight", "3"]) == 0
    served = read(tmp_path / "served.jsonl")
    assert served == greedy_in_process(corpus_target, tokenizer, CONVERSATIONS, tmp_path / "local.jsonl")
    assert len(served[1]) == 5 and served[1][2]["content"] != "a human reply, to be replaced"
    assert any(m["content"] for conv in served for m in conv if m["role"] == "assistant")
    assert not list(tmp_path.glob(".*partial"))

    # Plain text (the embedded default's prompts) goes through /v1/completions, as continuations.
    assert main(["data", "regenerate", "--target", str(corpus_target_dir), "--server", server.url, "--limit", "3",
                 "--out", str(tmp_path / "plain.jsonl"), "--temperature", "0",
                 "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert read(tmp_path / "plain.jsonl") == greedy_in_process(corpus_target, tokenizer, embedded_conversations(3),
                                                               tmp_path / "plain-local.jsonl", untemplated=True)


@pytest.mark.slow  # starts a second server (about 30 s on two cores)
def test_a_rerun_after_the_server_stopped_resumes_without_losing_or_repeating(
        server, corpus_target_dir, corpus_target, tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "regen.jsonl"
    sampling = decoding_for(corpus_target_dir, tokenizer, ReplyDecoding(max_new_tokens=NEW_TOKENS), False)
    doomed = LocalServer(corpus_target_dir, tmp_path / "doomed.log", threads=1)
    answer, asked = regen_server.answer_conversation, []

    def stop_at_third(client, messages, index):
        if index == 3:
            doomed.stop()  # mid-run: three conversations answered, the rest to go
        asked.append(index)
        return answer(client, messages, index)

    monkeypatch.setattr(regen_server, "answer_conversation", stop_at_third)
    try:
        with pytest.raises(DraftsmithError, match=rf"server {doomed.url}: unreachable .*gave up after 2 tries"):
            regenerate_via_servers([doomed.url], str(corpus_target_dir), tokenizer, CONVERSATIONS, out, sampling,
                                   limits=fast_limits(in_flight=1))
    finally:
        doomed.stop()
    (partial,) = tmp_path.glob(".regen.jsonl.*.partial")
    assert not out.exists() and len(read(partial)) == 3

    asked.clear()  # the rerun asks another server: the partial file is keyed by the work, not the URL
    regenerate_via_servers([server.url], str(corpus_target_dir), tokenizer, CONVERSATIONS, out, sampling,
                           limits=fast_limits())
    assert sorted(asked) == [3, 4, 5]
    assert read(out) == greedy_in_process(corpus_target, tokenizer, CONVERSATIONS, tmp_path / "local.jsonl")


def test_a_recipe_names_the_server_dataset_folder_and_columns(server, corpus_target_dir, corpus_target, tokenizer, tmp_path):
    folder = hub_folder(tmp_path / "hub")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"target": {"path": str(corpus_target_dir)}, "data": {
        "dataset": str(folder), "dataset_config": "mtbench", "dataset_split": "test",
        "columns": {"turns": "questions"}, "regen_servers": [server.url], "regen_in_flight": 2}}))
    assert main(["data", "regenerate", "--recipe", str(recipe), "--out", str(tmp_path / "out.jsonl"),
                 "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]) == 0
    expected = [[{"role": "user", "content": q} for q in row["questions"]] for row in MTBENCH]
    assert read(tmp_path / "out.jsonl") == greedy_in_process(corpus_target, tokenizer, expected, tmp_path / "local.jsonl")


def test_post_hoc_training_data_comes_from_the_recipes_server(server, corpus_target_dir, corpus_target, tokenizer, tmp_path):
    from draftsmith.data.posthoc_rows import conversations_file
    from draftsmith.recipe import load_recipe

    data = write_jsonl(tmp_path / "convs.jsonl", CONVERSATIONS[:3])
    recipe = load_recipe(None, [f"target.path={corpus_target_dir}", f"data.dataset={data}",
                                f'data.regen_servers=["{server.url}"]', "data.regen_temperature=0",
                                f"data.regen_max_new_tokens={NEW_TOKENS}"])
    source, untemplated = conversations_file(recipe, None, tokenizer, corpus_target_dir)  # the target is not needed: the server answers
    assert not untemplated
    assert read(source) == greedy_in_process(corpus_target, tokenizer, CONVERSATIONS[:3], tmp_path / "local.jsonl")


def test_bad_servers_are_refused_in_one_line_and_nothing_written_is_lost(server, corpus_target_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "convs.jsonl", CONVERSATIONS[:2])
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier run's file\n")
    other = tmp_path / "other"  # the same weights under another name: not the target the server names
    shutil.copytree(corpus_target_dir, other)
    retrained = tmp_path / "copy" / corpus_target_dir.name  # same name, another tokenizer
    shutil.copytree(corpus_target_dir, retrained)
    train_tokenizer(load_embedded_corpus("train", max_chars=60_000), vocab_size=300, out_dir=tmp_path / "tok")
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, retrained / file.name)
    cases = [
        (corpus_target_dir, f"http://127.0.0.1:{free_port()}", "unreachable on /v1/models"),
        (other, server.url, f"serves {corpus_target_dir}, not the target {other}"),
        (retrained, server.url, "prompt tokens for a probe the target's tokenizer makes"),
    ]
    for folder, url, message in cases:
        code = main(["data", "regenerate", "--target", str(folder), "--dataset", str(data), "--server", url,
                     "--out", str(out), "--temperature", "0"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("draftsmith: error: server "), err
        assert message in err[0], err
    assert out.read_text() == "an earlier run's file\n"
    assert not list(tmp_path.glob(".out.jsonl*"))


def test_a_target_retrained_in_its_folder_does_not_resume_the_old_answers(corpus_target_dir, tokenizer, tmp_path,
                                                                          monkeypatch):
    """The partial file is keyed on the target's weights, not its folder: no server is
    needed to see it, a stand-in client answers."""
    class Stand:
        surrogates = 0  # ServerClient's count of lone surrogates replaced in its answers

        def __init__(self, url, target, tokenizer, untemplated, sampling, limits):
            self.sampling = sampling

        def complete(self, history, seed, request=""):
            return f"reply {seed}", 1

    answer, asked = regen_server.answer_conversation, []

    def stop_at(index_to_fail):
        def answering(client, messages, index):
            if index == index_to_fail:
                raise DraftsmithError("stopped")
            asked.append(index)
            return answer(client, messages, index)
        return answering

    monkeypatch.setattr(regen_server, "ServerClient", Stand)
    folder, out = tmp_path / "target", tmp_path / "regen.jsonl"
    shutil.copytree(corpus_target_dir, folder)
    sampling = ReplyDecoding(max_new_tokens=NEW_TOKENS, stop_ids=(0,))
    run = lambda: regenerate_via_servers(["http://stand-in"], str(folder), tokenizer, CONVERSATIONS, out,  # noqa: E731
                                         sampling, limits=fast_limits(in_flight=1))
    for fail, first_asked in ((2, 0), (4, 2)):  # the second run resumes after the first's two answers
        monkeypatch.setattr(regen_server, "answer_conversation", stop_at(fail))
        asked.clear()
        with pytest.raises(DraftsmithError, match="stopped"):
            run()
        assert asked[0] == first_asked
    model = load_target(folder)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(1.0)
    model.save_pretrained(folder)  # retrained in place: the old answers are not its
    monkeypatch.setattr(regen_server, "answer_conversation", stop_at(-1))
    asked.clear()
    assert len(read(run())) == len(CONVERSATIONS)
    assert asked == list(range(len(CONVERSATIONS)))


# ---------------------------------------------------------------- every process of a launch

def run_processes(world, job):
    """`job(Processes)` as each process of a launch would run it, the main one last: every
    other process has written its files when the main one merges (barriers are no-ops)."""
    results = [job(Processes(rank, world)) for rank in reversed(range(world))]
    return results[-1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_processes_share_regeneration_and_merge_to_one_processs_file(corpus_target, tokenizer, tmp_path, temperature):
    conversations = CONVERSATIONS[:5]  # batches of 2: [0 1] [2 3] [4]; process 0 answers two, process 1 one
    settings = dict(how=ReplyDecoding(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=3), batch_size=2)
    single = regenerate(corpus_target, tokenizer, conversations, tmp_path / "one.jsonl", **settings)
    merged = run_processes(2, lambda procs: regenerate(corpus_target, tokenizer, conversations, tmp_path / "two.jsonl",
                                                       processes=procs, **settings))
    assert merged.read_bytes() == single.read_bytes()
    assert not list(tmp_path.glob(".*partial*"))


def test_a_process_resumes_its_own_share(corpus_target, tokenizer, tmp_path, monkeypatch):
    import draftsmith.data.regenerate as regen

    conversations = CONVERSATIONS[:5]
    settings = dict(how=ReplyDecoding(max_new_tokens=NEW_TOKENS), batch_size=2)
    single = regenerate(corpus_target, tokenizer, conversations, tmp_path / "one.jsonl", **settings)
    regenerate(corpus_target, tokenizer, conversations, tmp_path / "two.jsonl", processes=Processes(1, 2), **settings)
    answer, answered = regen._answer, []
    monkeypatch.setattr(regen, "_answer", lambda t, tok, batch, first, *how: answered.append(first) or
                        answer(t, tok, batch, first, *how))
    # Process 1 is restarted: its batch is on disk, so only process 0's batches are answered.
    run_processes(2, lambda procs: regenerate(corpus_target, tokenizer, conversations, tmp_path / "two.jsonl",
                                              processes=procs, **settings))
    assert answered == [0, 4]
    assert (tmp_path / "two.jsonl").read_bytes() == single.read_bytes()


def test_processes_share_the_feature_cache(corpus_target, tmp_path):
    tokens = {"input_ids": torch.randint(0, 500, (7, 12)), "loss_mask": torch.ones(7, 12, dtype=torch.long),
              "attention_mask": torch.ones(7, 12, dtype=torch.long)}

    def compute(batch):
        with torch.no_grad():
            return {"hidden": corpus_target(batch["input_ids"], output_hidden_states=True).hidden_states[1]}

    identity = {"target": {"path": "tiny", "fingerprint": {"weights": "x"}}, "method": "test"}
    single = write_feature_cache(tmp_path / "one", identity, tokens, compute, batch_size=2, shard_rows=2)
    shared = run_processes(3, lambda procs: write_feature_cache(tmp_path / "three", identity, tokens, compute,
                                                                batch_size=2, shard_rows=2, processes=procs))
    one, three = (json.loads((d / "manifest.json").read_text()) for d in (single, shared))
    assert one == three and three["complete"] and len(three["shards"]) == 4
    for name in ["rows.safetensors"] + [s["file"] for s in one["shards"]]:
        assert (single / name).read_bytes() == (shared / name).read_bytes(), name


# ---------------------------------------------------------------- datasets in the hub layout

ULTRACHAT = [{"prompt": f"q{i}", "prompt_id": str(i), "messages": [
    {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
SHAREGPT = [{"id": str(i), "conversations": [{"from": "human", "value": f"h{i}"}, {"from": "gpt", "value": "g"}]}
            for i in range(2)]
MTBENCH = [{"question_id": i, "questions": [f"first {i}", f"then {i}"]} for i in range(2)]


def hub_folder(folder: Path) -> Path:
    """A dataset as it sits on the hub: parquet files under data/, configs in the README."""
    import datasets

    configs = {"default": ("train_sft", ULTRACHAT), "sharegpt": ("train", SHAREGPT), "mtbench": ("test", MTBENCH)}
    card = ["---", "configs:"]
    for name, (split, rows) in configs.items():
        (folder / "data" / name).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / name / f"{split}-00000-of-00001.parquet"))
        card += [f"- config_name: {name}", "  data_files:", f"  - split: {split}", f"    path: data/{name}/{split}-*"]
    (folder / "README.md").write_text("\n".join(card + ["---", "A test dataset."]) + "\n")
    return folder


def test_dataset_folders_in_the_hub_layout_give_conversations(tmp_path):
    folder = hub_folder(tmp_path / "hub")
    assert load_conversations(folder, split="train_sft", limit=2) == [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(2)]
    assert load_conversations(folder, config="sharegpt") == [
        [{"role": "user", "content": f"h{i}"}, {"role": "assistant", "content": "g"}] for i in range(2)]
    assert load_conversations(folder, config="mtbench", split="test", columns={"turns": "questions"}) == [
        [{"role": "user", "content": f"first {i}"}, {"role": "user", "content": f"then {i}"}] for i in range(2)]
    # A mapping picks the column even where another shape's column is also there.
    assert load_conversations(folder, split="train_sft", columns={"prompt": "prompt"}) == [
        [{"role": "user", "content": f"q{i}"}] for i in range(3)]


@pytest.mark.parametrize("args, message", [
    (dict(path="nobody/no-such-dataset"), "dataset nobody/no-such-dataset: not a local path, and not in the "
                                          "Hugging Face cache"),
    (dict(split="validation"), "Unknown split"),
    (dict(split="train_sft", columns={"messages": "chosen"}),
     "data.columns: {hub} has no column 'chosen' for messages (columns: messages, prompt, prompt_id)"),
    (dict(split="train_sft", columns={"messages": "prompt"}),
     "record 0: expected a list of message objects (data.columns {messages: prompt})"),
    (dict(split="train_sft", columns={"chat": "messages"}), "data.columns: unknown shape 'chat'"),
])
def test_bad_datasets_are_refused_in_one_line(tmp_path, args, message):
    folder = hub_folder(tmp_path / "hub")
    args = {"path": folder, **args}
    with pytest.raises(DraftsmithError) as caught:
        load_conversations(**args)
    text = str(caught.value)
    assert message.replace("{hub}", str(folder)) in text and "\n" not in text


@pytest.mark.slow  # two launched processes, each importing torch and transformers
def test_two_launched_processes_write_the_file_one_process_writes(corpus_target_dir, corpus_target, tokenizer, tmp_path):
    import os
    import subprocess
    import sys

    from draftsmith.data.conversations import load_conversations

    data = write_jsonl(tmp_path / "convs.jsonl", CONVERSATIONS[:5])
    sampled = ["--temperature", "1.0", "--top-p", "1.0", "--top-k", "0", "--seed", "5", "--batch-size", "2",
               "--max-new-tokens", str(NEW_TOKENS)]
    root = Path(__file__).resolve().parents[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(root / "recipes" / "accelerate" / "ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
              "--main_process_port", str(free_port()), "-m", "draftsmith.cli", "data", "regenerate",
              "--target", str(corpus_target_dir), "--dataset", str(data), "--out", str(tmp_path / "two.jsonl"), *sampled]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launch, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    single = regenerate(corpus_target, tokenizer, load_conversations(data), tmp_path / "one.jsonl",
                        ReplyDecoding(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5), batch_size=2)
    assert (tmp_path / "two.jsonl").read_bytes() == single.read_bytes()
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.slow  # two launched processes, each importing torch and transformers
def test_two_launched_processes_write_the_feature_cache_one_process_writes(corpus_target_dir, tmp_path):
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tiny_runs import ROOT, overrides

    deeper = tmp_path / "deeper"  # EAGLE-3 reads three target layers: four at least
    tokenizer = AutoTokenizer.from_pretrained(str(corpus_target_dir))
    build_tiny_target(vocab_size=len(tokenizer), num_layers=4, hidden_size=64, num_heads=4,
                      num_kv_heads=1).save_pretrained(deeper)
    tokenizer.save_pretrained(deeper)
    small = overrides(tmp_path / "run", target__path=str(deeper), data__num_conversations=12,
                      data__prompt_chars=80, data__regen_max_new_tokens=8, train__seq_len=48,
                      method__draft_vocab_size=64, method__ttt_length=2)
    args = ["data", "cache-hidden", "--recipe", str(ROOT / "recipes" / "tiny" / "eagle3.yaml"), "--method", "eagle3",
            *small, "--shard-rows", "3", "--batch-size", "2"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "recipes" / "accelerate" / "ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
              "--main_process_port", str(free_port()), "-m", "draftsmith.cli", *args, "--out", str(tmp_path / "two")]
    done = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    one, two = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two"))
    assert one == two and two["complete"] and len(two["shards"]) > 2
    for name in ["rows.safetensors"] + [s["file"] for s in one["shards"]]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
