"""The README stays true: every knob documented, CI runs the README's test command."""

from pathlib import Path

from adaspec.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [env_name(f) for f in Settings.model_fields if f"`{env_name(f)}`" not in readme]
    assert not missing


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = readme.split("Run the tests")[1].split("```bash\n")[1].split("\n")[0]
    assert test_cmd in ci.splitlines()
    install = readme.split("```bash\n")[1].split(" && adaspec generate")[0]
    for step in install.split(" && "):
        if step.startswith("pip install"):
            assert f"python -m {step}".replace("pip install", "pip install --quiet") in ci
