"""Every cross-reference resolves: the README's anchor links (#...) name one of its headings, its relative links
(and the notebooks') name files that exist, and every README section named in a docstring, comment or notebook
(`README section "X"`, `README's "X"`, `README, "X"`) begins a real heading of the README. Text only, no imports
of the course: well under a second."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _without_code(text: str) -> str:
    """Markdown without fenced or indented code blocks (a `#` or `](` there is not a link or a heading)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return "\n".join(l for l in text.split("\n") if not l.startswith("    "))


def headings(text: str) -> list[str]:
    return [m.group(2).strip() for m in re.finditer(r"^(#{1,6}) (.+)$", _without_code(text), flags=re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, each space a hyphen."""
    s = heading.lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def links(text: str) -> list[str]:
    """The targets of the markdown links and images in `text`, code blocks aside."""
    return re.findall(r"\]\(([^)\s]+)\)", _without_code(text))


def _markdown_of_notebooks() -> dict:
    import json
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        with open(path) as f:
            cells = json.load(f)["cells"]
        out[path] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return out


def _sources() -> dict:
    """Every course file, the package's modules and the notebooks (all their cells): where a README section is named."""
    paths = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "lab", "**", "*.py"), recursive=True)
    out = {p: open(p).read() for p in sorted(paths)}
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        out[path] = open(path).read().replace('\\"', '"')
    return out


# a named README section: README section "X", README's "X", README, "X" (README.md of another repository, as in
# `network/README.md`, is a source, not a reference)
NAMED = re.compile(r"""(?<![/\w])README(?:'s)?,?(?: section)?,? "([^"\n]+)\"""")
MENTION = re.compile(r"""(?<![/\w])README(?:'s|,? section|,? ")""")


def test_every_readme_anchor_names_a_heading():
    text = open(README).read()
    anchors = {slug(h) for h in headings(text)}
    wanted = [l[1:] for l in links(text) if l.startswith("#")]
    assert wanted, "the README links no section"
    missing = sorted({a for a in wanted if a not in anchors})
    assert not missing, f"README links to sections that do not exist: {missing}"


def test_every_relative_link_names_a_file():
    pages = {README: open(README).read(), **_markdown_of_notebooks()}
    missing = []
    for page, text in pages.items():
        for target in links(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                missing.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_every_named_readme_section_exists():
    titles = [h.replace("`", "").lower() for h in headings(open(README).read())]
    wrong = []
    for path, text in _sources().items():
        named = {m.start(): m.group(1) for m in NAMED.finditer(text)}
        for m in MENTION.finditer(text):
            name = named.get(m.start())
            if name is None or not any(t.startswith(name.replace("`", "").lower()) for t in titles):
                line = text[:m.start()].count("\n") + 1
                wrong.append(f"{os.path.relpath(path, ROOT)}:{line}: {text[m.start():m.start() + 80]!r}")
    assert not wrong, "README sections named that are not its headings (name one in quotes):\n" + "\n".join(wrong)


def test_the_checks_catch_a_broken_reference():
    # the slug of a real heading, a wrong one, and a mention naming a section that does not exist
    assert slug("Lesson 0 — ranks, process groups and the mesh (`mesh.py`)") == \
        "lesson-0--ranks-process-groups-and-the-mesh-meshpy"
    assert slug("Write it yourself: each lesson's core, graded") == "write-it-yourself-each-lessons-core-graded"
    assert links("see [x](#nowhere) and ![p](notebooks/none.png)") == ["#nowhere", "notebooks/none.png"]
    text = 'README section "Formulas, conventions and sources"'
    assert NAMED.search(text).group(1) == "Formulas, conventions and sources"
    assert MENTION.search("the README's table") and not NAMED.search("the README's table")
    assert NAMED.search('(README, "How some numbers were chased down")').group(1) == "How some numbers were chased down"
    assert MENTION.search('README "Formulas"') and not MENTION.search("network/README.md, and README.md")
