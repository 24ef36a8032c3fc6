"""The plugin host: registration, provenance, errors, allowlist and real entry points."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from conftest import PROMPTS
from tokenmill import LLM, SamplingParams, hookimpl, load_config
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import PluginManager, make_plugin_manager
from tokenmill.interfaces import hookspecs
from tokenmill.interfaces.errors import (
    ComponentUnavailable,
    ConfigError,
    DuplicateComponent,
    PluginLoadFailed,
    UnknownComponent,
)


class PolicyPlugin:
    """A plugin defined inside the test, registering one policy."""

    def __init__(self, name="mine"):
        self.name = name

    @hookimpl
    def register_scheduling_policies(self, register):
        from tokenmill.plugins.schedulers.fifo import FifoPolicy
        register(self.name, FifoPolicy)


def fresh_manager(*plugins) -> PluginManager:
    pm = PluginManager()
    for i, plugin in enumerate(plugins):
        pm.register_plugin(plugin, f"test-plugin-{i}")
    pm.check_pending()
    return pm


def test_registrations_record_their_plugin():
    """Each registered name knows which plugin registered it."""
    components = collect_components(fresh_manager(PolicyPlugin("a"), PolicyPlugin("b")))
    entries = {e.name: e.plugin for e in components.scheduling_policies.entries()}
    assert entries == {"a": "test-plugin-0", "b": "test-plugin-1"}


def test_duplicate_names_name_both_plugins():
    """Two plugins registering the same policy name is an error naming both."""
    with pytest.raises(DuplicateComponent) as info:
        collect_components(fresh_manager(PolicyPlugin("same"), PolicyPlugin("same")))
    assert "test-plugin-0" in str(info.value) and "test-plugin-1" in str(info.value)


def test_unknown_name_lists_what_is_available():
    """Selecting an unregistered name fails with the available names."""
    components = collect_components(fresh_manager(PolicyPlugin("alpha")))
    with pytest.raises(UnknownComponent) as info:
        components.scheduling_policies.get("beta")
    assert info.value.available == ["alpha"] and "alpha" in str(info.value)


def test_lazy_factories_import_only_when_selected():
    """A 'module:attr' factory costs nothing until chosen, then fails with the reason."""

    class Lazy:
        @hookimpl
        def register_attention_backends(self, register):
            register("ghost", "tokenmill_no_such_module.kernels:Backend")

    components = collect_components(fresh_manager(Lazy()))
    assert components.attention_backends.names() == ["ghost"]
    with pytest.raises(ComponentUnavailable, match="tokenmill_no_such_module"):
        components.attention_backends.get("ghost")


def test_misspelled_hook_is_caught():
    """A hookimpl for a hook that does not exist is reported, not ignored."""

    class Typo:
        @hookimpl
        def register_scheduling_policy(self, register):
            pass

    with pytest.raises(Exception, match="unknown hook"):
        fresh_manager(Typo())


def test_installed_contrib_package_is_discovered_through_its_entry_point():
    """The separately installed contrib package registers its policy like any plugin."""
    pm = make_plugin_manager()
    info = pm.info["shortest_prompt"]
    assert info.distribution == "tokenmill-shortest-prompt" and info.version == "0.1.0"
    components = collect_components(pm)
    assert components.scheduling_policies.get("shortest-prompt").__module__ == "tokenmill_shortest_prompt"
    assert "fifo" in components.scheduling_policies


@pytest.mark.parametrize("env,expected", [
    ({"TOKENMILL_PLUGINS": ""}, False),
    ({"TOKENMILL_PLUGINS": "tokenmill-shortest-prompt"}, True),
    ({"TOKENMILL_PLUGINS": "some-other-dist"}, False),
    ({"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"}, False),
    ({"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0"}, True),
])
def test_allowlist_and_autoload_switches_are_read_at_call_time(monkeypatch, env, expected):
    """Env switches filter third-party plugins; tokenmill's own always load."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pm = make_plugin_manager()
    assert ("shortest_prompt" in pm.info) is expected
    assert {"fifo", "torch_attention", "llama"} <= set(pm.info)


def test_a_plugin_that_fails_to_import_is_named_with_the_way_to_leave_it_out(monkeypatch, tmp_path):
    """A third-party entry point whose import raises (a missing dependency, a plugin written
    against another tokenmill) stops the engine and the CLI with its name, its distribution and
    the switches that leave it out, not a traceback; the allowlist then starts without it."""
    (tmp_path / "broken_plugin").mkdir()
    (tmp_path / "broken_plugin" / "__init__.py").write_text("import a_module_nobody_installed\n")
    info = tmp_path / "broken_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[{hookspecs.ENTRY_POINT_GROUP}]\nbroken = broken_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for switch in ("TOKENMILL_PLUGINS", "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(switch, raising=False)
    with pytest.raises(PluginLoadFailed, match=r"plugin 'broken' \(distribution broken-plugin 0.3\) failed to "
                       r"import: ModuleNotFoundError: No module named 'a_module_nobody_installed'.*"
                       r"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD=1"):
        make_plugin_manager()
    cli = subprocess.run([sys.executable, "-m", "tokenmill.cli", "plugins"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.strip().splitlines()[-1].startswith("tokenmill: error: plugin 'broken'"), cli.stderr
    monkeypatch.setenv("TOKENMILL_PLUGINS", "tokenmill-shortest-prompt")
    assert "shortest_prompt" in make_plugin_manager().info


def test_bad_switch_value_is_an_error(monkeypatch):
    """A malformed boolean env var fails loudly instead of being guessed."""
    monkeypatch.setenv("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", "maybe")
    with pytest.raises(ConfigError, match="TOKENMILL_DISABLE_PLUGIN_AUTOLOAD"):
        make_plugin_manager()


def test_contrib_policy_selected_from_yaml_changes_admission_order(model_dir, tmp_path):
    """shortest-prompt, chosen in YAML, admits the short prompt first although it came second."""
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir("llama")),
        "scheduler": {"policy": "shortest-prompt", "max_num_seqs": 1},
        "cache": {"kv_cache_memory": "16MiB"},
    }))
    llm = LLM.from_config(config)
    engine = llm.llm_engine
    assert type(engine.scheduler.policy).__name__ == "ShortestPromptFirst"
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.add_request("short", {"prompt_token_ids": PROMPTS[0][:3]}, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["short", "long"]


def test_auto_backend_choice_is_a_firstresult_hook(model_dir):
    """A plugin answering select_attention_backend overrides the built-in trylast default."""
    from tokenmill.plugins.attention.torch_ref import TorchReferenceAttention

    class Chosen(TorchReferenceAttention):
        name = "chosen"

    class Selector:
        @hookimpl
        def register_attention_backends(self, register):
            register("chosen", Chosen)

        @hookimpl
        def select_attention_backend(self, device, model_config):
            return "chosen"

    pm = make_plugin_manager()
    pm.register_plugin(Selector(), "selector")
    llm = LLM(config=load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**24), plugin_manager=pm)
    attention = llm.llm_engine.runner.model.model.layers[0].self_attn.attn
    assert isinstance(attention.backend, Chosen)


def test_observer_hooks_see_engine_and_finished_requests(model_dir):
    """engine_started fires once per engine, request_finished once per request."""
    seen = {"engines": 0, "finished": []}

    class Observer:
        @hookimpl
        def engine_started(self, engine):
            seen["engines"] += 1

        @hookimpl
        def request_finished(self, output, metrics):
            seen["finished"].append((output.request_id, metrics.num_generation_tokens))

    pm = make_plugin_manager()
    pm.register_plugin(Observer(), "observer")
    llm = LLM(config=load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**24), plugin_manager=pm)
    llm.generate(["a b", "c d"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen["engines"] == 1
    assert sorted(seen["finished"]) == [("0", 3), ("1", 3)]


def test_unknown_component_in_config_fails_at_startup(model_dir):
    """A config naming a missing backend fails when the engine is built, listing choices."""
    with pytest.raises(UnknownComponent, match="available: .*torch") as info:
        LLM(str(model_dir("llama")), attention_backend="flash", kv_cache_memory_bytes=2**24)
    assert {"cpu", "torch", "triton"} <= set(info.value.available)


def test_lora_without_an_adapter_plugin_fails_at_startup(model_dir):
    """enable_lora needs a registered 'lora' adapter type; without one the engine refuses to start."""
    from tokenmill.plugins.attention import torch_ref
    from tokenmill.plugins.models import llama
    from tokenmill.plugins.platforms import cpu
    from tokenmill.plugins.schedulers import fifo

    pm = fresh_manager(fifo, torch_ref, llama, cpu)
    config = load_config(model=str(model_dir("llama")), enable_lora=True, kv_cache_memory_bytes=2**24)
    with pytest.raises(UnknownComponent, match="adapter type 'lora'"):
        LLM(config=config, plugin_manager=pm)


def test_every_hook_spec_is_documented_in_the_readme():
    """The README's hook reference lists every hook spec, and nothing that is not one."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    specs = {name for name in dir(hookspecs) if getattr(getattr(hookspecs, name), "tokenmill_spec", None)}
    assert specs and all(f"`{name}(" in readme for name in specs)
    assert hookspecs.HOOKSPEC_VERSION >= 1
