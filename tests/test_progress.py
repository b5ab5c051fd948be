"""The console: progress of long stages (tqdm's bar on a terminal, whole lines elsewhere: a scheduler's log, CI), and
another library's repeated warning shown once."""

from __future__ import annotations

import io
import time

from neoembed import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_where_output_is_not_a_terminal():
    out = io.StringIO()
    b = progress.bar(total=1000, desc="embedding corpus", unit="text", stream=out, delay=0, interval=0)
    for _ in range(4):
        time.sleep(0.01)
        b.update(250)
    b.close()  # the last update's line already says 1,000: closing repeats nothing
    b.close()  # a second close writes nothing
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert [line.split()[2] for line in lines] == ["250/1,000", "500/1,000", "750/1,000", "1,000/1,000"]
    assert all(line.startswith("embedding corpus: ") and " text/s" in line for line in lines)
    assert "left " not in lines[0] and all("left " in line for line in lines[1:])  # paced from the first update
    assert "(100%)" in lines[-1]


def test_a_quick_stage_stays_silent_and_a_long_one_is_throttled():
    out = io.StringIO()
    for _ in progress.bar(range(50), desc="quick", unit="batch", stream=out):  # the default delay
        pass
    assert out.getvalue() == ""
    out = io.StringIO()
    with progress.bar(total=None, desc="rows", unit="row", stream=out, delay=0, interval=3600) as b:
        for _ in range(100):
            b.update(1)
    lines = out.getvalue().splitlines()  # the first update past the delay, then only the end
    assert [line.split()[1] for line in lines] == ["1", "100"] and "left" not in lines[-1]


def test_iterating_counts_every_item_and_resumed_counts_start_at_initial():
    out = io.StringIO()
    seen = list(progress.bar(iter(range(7)), desc="scan", unit="row", stream=out, delay=0, interval=3600))
    assert seen == list(range(7)) and out.getvalue().splitlines()[-1].split()[1] == "7"
    out = io.StringIO()
    b = progress.bar(total=10, initial=6, desc="tokenizing", unit="doc", stream=out, delay=0, interval=0)
    b.update(4)
    b.close()
    assert out.getvalue().splitlines()[0].split()[1] == "10/10"


def test_a_terminal_gets_tqdm_and_disable_gets_nothing():
    from tqdm.auto import tqdm

    term = _Terminal()
    b = progress.bar(total=3, desc="bar", unit="it", stream=term)
    assert isinstance(b, tqdm)
    b.update(3)
    b.close()
    assert "\r" in term.getvalue()  # a redrawn bar
    out = io.StringIO()
    b = progress.bar(total=3, desc="off", stream=out, disable=True, delay=0, interval=0)
    b.update(3)
    b.close()
    assert out.getvalue() == ""


def test_another_librarys_repeated_warning_shows_once():
    """As a neoembed mteb run over eight tasks printed them eight times each: sentence-transformers' prompt notice
    (its first line the same, the rest naming the task) and mteb's deprecation warning, issued after a
    warnings.catch_warnings that makes the warnings module's own "once" forget it."""
    import subprocess
    import sys

    code = (
        "import logging, warnings\n"
        "from neoembed.cli import _console_logging\n"
        "_console_logging(verbose=False)\n"
        "log = logging.getLogger('sentence_transformers.prompts')\n"  # no handler of its own: the last resort
        "for task in ('STS12', 'STS13', 'STS14'):\n"
        "    log.warning('Model prompts specified, these will overwrite the default model prompts.')\n"
        "    log.warning(f'Current prompts will be:\\n {{{task!r}: \"\"}}')\n"
        "    with warnings.catch_warnings():\n"
        "        pass\n"
        "    warnings.warn('The fill_missing parameter is ignored', UserWarning)\n"
        "    warnings.warn('This class is deprecated', DeprecationWarning)\n"
        "log.warning('a different warning')\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.count("Model prompts specified") == 1 and "a different warning" in err
    assert err.count("Current prompts will be") == 1 and "STS12" in err and "STS13" not in err
    assert err.count("fill_missing parameter is ignored") == 1
    # a library's deprecation notice is for code calling it, not for the command line's user (#44's walk: mteb's
    # reranking tasks print one on every run); --verbose shows it
    assert "deprecated" not in err, err
    verbose = code.replace("verbose=False", "verbose=True")
    err = subprocess.run([sys.executable, "-c", verbose], capture_output=True, text=True, check=True).stderr
    assert "This class is deprecated" in err


def test_library_noise_keeps_other_libraries_off_the_console_and_neoembeds_on():
    """What `neoembed export` prints: torch's exporter logged a dozen notices and warnings about its own internals,
    onnxruntime's quantizer advice for image models on the root logger; neoembed's own warnings still show, and
    everything shows with --verbose."""
    import subprocess
    import sys

    code = (
        "import logging, warnings, sys\n"
        "from neoembed.cli import _console_logging\n"
        "from neoembed.progress import library_noise\n"
        "from neoembed.sentence import TruncationWarning\n"
        "import neoembed.progress as own\n"
        "_console_logging(verbose=sys.argv[1] == 'v')\n"
        "with library_noise('torch.onnx', ''):\n"
        "    logging.getLogger('torch.onnx._internal.x').warning('torchvision is not installed')\n"
        "    logging.warning('Please consider to run pre-processing')\n"
        "    warnings.warn('axis name batch will not be used', UserWarning)\n"
        "    warnings.warn_explicit('1 text(s) exceed max_seq_length', TruncationWarning, own.__file__, 7)\n"
        "    warnings.warn_explicit('a library warning that names its neoembed caller', UserWarning, own.__file__, 8)\n"
        "    logging.basicConfig()\n"  # onnxruntime's quantizer does: a root handler doubling every later line
        "logging.getLogger('torch.onnx').error('after the block: shown')\n"
        "logging.getLogger('neoembed.export').info('once only')\n"
    )
    quiet = subprocess.run(
        [sys.executable, "-c", code, "q"], capture_output=True, text=True, check=True
    ).stderr
    assert "torchvision" not in quiet and "pre-processing" not in quiet and "axis name" not in quiet
    assert "names its neoembed caller" not in quiet  # the file a library's warning names does not make it ours
    # neoembed's own warning: kept, as one plain line without the warnings module's source line
    assert "warning: 1 text(s) exceed max_seq_length\n" in quiet and "UserWarning" not in quiet
    assert "after the block: shown" in quiet  # the loggers' levels are restored
    assert quiet.count("once only") == 1, quiet  # and the root logger's handlers (#44's walk: export's last line)
    loud = subprocess.run(
        [sys.executable, "-c", code, "v"], capture_output=True, text=True, check=True
    ).stderr
    assert all(s in loud for s in ("torchvision", "pre-processing", "axis name", "exceed max_seq_length"))


def test_neoembeds_own_warning_class_prints_plainly_whichever_library_called():
    """The truncation warning names the caller of ``encode`` (mteb's wrapper, under ``neoembed mteb``): it printed
    as another library's warning, with mteb's source line; its class says it is neoembed's."""
    from neoembed.cli import _plain_own_warning
    from neoembed.sentence import TruncationWarning

    elsewhere = "/site-packages/mteb/models/sentence_transformer_wrapper.py"
    said = _plain_own_warning("39 text(s) exceed max_seq_length=64 tokens", TruncationWarning, elsewhere, 344)
    assert said == "warning: 39 text(s) exceed max_seq_length=64 tokens\n"
    assert "UserWarning" in _plain_own_warning("a library's", UserWarning, elsewhere, 344)


def test_a_run_logging_rarely_still_prints_a_line_every_interval(tmp_path, capsys, monkeypatch):
    """#44 walk: where output is not a terminal the run loop printed a line per logging step only, so a quickstart
    (logging every 10 steps) said nothing for minutes after "fine-tuning ...". Between logging steps it now prints
    one every PLAIN_INTERVAL seconds (here 0: after every step)."""
    from types import SimpleNamespace

    import neoembed.loop
    from neoembed.loop import RunLoop, StepOutput
    from neoembed.recipe import load_recipe
    from neoembed.train.recipe import UnifiedRecipe

    monkeypatch.setattr(neoembed.loop, "PLAIN_INTERVAL", 0.0)
    overrides = ["steps=4", "logging_steps=100", "save_steps=100", f"output_dir={tmp_path}"]
    recipe = load_recipe("tiny", UnifiedRecipe, overrides)
    acc = SimpleNamespace(
        is_main_process=True, register_for_checkpointing=lambda obj: None, clip_grad_norm_=lambda p, c: 0.0
    )
    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None)
    scheduler = SimpleNamespace(step=lambda: None, get_last_lr=lambda: [1e-3])
    loop = RunLoop(acc, recipe, tmp_path, optimizer=optimizer, scheduler=scheduler, parameters=list,
                   grad_clip=1.0, settings=None)  # fmt: skip
    loop.save = lambda: None
    loop.run(lambda step, stop: StepOutput(1.0, False, {"loss": 1.0}), lambda sums, *a: {"loss": 1.0})
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], lines
    assert "loss 1" in lines[-1] and "left" in lines[0]  # the logging step's values; the time left on each


def test_time_left_is_paced_after_the_start_up(monkeypatch):
    """The first lines of a mining run said "left 2:10:03" for a job done in minutes: the time left was paced from
    the bar's start, and the first batch came only after a whole shard was tokenized (#43, walk C). It is paced
    from the first update on."""
    clock = iter([0.0, 9.0, 9.0, 10.0, 10.0, 10.0])  # created; 128 texts at 9 s; 1,128 at 10 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    b = progress.bar(total=101_128, desc="embedding corpus", unit="text", stream=out, delay=0, interval=0)
    b.update(128)
    b.update(1000)
    first, second = out.getvalue().splitlines()
    assert "left" not in first and second.endswith("left 01:40")  # 100,000 texts at 1,000 a second
