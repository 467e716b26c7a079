//! The bundle's chain of stages as a Graphviz DOT digraph, for people: stages are folded to
//! their top-level module (`layer2`, `fc`), each edge names the cut it crosses and what
//! crosses it per sample. With a chosen cut, that edge is drawn red and the nodes are filled
//! by the side that runs them; a module the cut falls inside is unfolded, one level at a
//! time, until the cut lies between two nodes.
//!
//! [`render_svg`] runs Graphviz's `dot` when it is installed; nothing here needs it.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cleave_common::bundle::{Bundle, StageInfo};
use cleave_tables::{human_bytes, si, thousands};

/// The DOT file's name inside the directory given to [`write_stage_graph`].
pub const STAGE_GRAPH_DOT: &str = "stage_graph.dot";
/// The SVG file's name inside the directory given to [`write_stage_graph`].
pub const STAGE_GRAPH_SVG: &str = "stage_graph.svg";

/// Fill of the nodes the edge device runs (stages before the chosen cut).
const EDGE_FILL: &str = "#cfe2f3";
/// Fill of the nodes the server runs (stages from the chosen cut on).
const SERVER_FILL: &str = "#fce5cd";
/// Fill of every node when no cut is chosen.
const PLAIN_FILL: &str = "#f3f3f3";

/// One node of the graph: a run of consecutive stages that share a module path prefix.
#[derive(Debug, Clone, PartialEq)]
struct StageGroup {
    /// The shared prefix (`layer2`, `layer2.0`), or the stage's own name for a single stage.
    label: String,
    /// The stages it covers.
    stages: Range<usize>,
}

/// The bundle as a DOT digraph: an `input` node, one node per top-level module (its stage
/// range, parameters and FLOPs per sample), an `output` node, and an edge per cut between
/// them labelled with the cut index, its bytes per sample and, when more than one, the
/// number of tensors crossing. Unusable cuts are dashed.
///
/// With `chosen_cut = Some(k)` the edge crossing cut k is red, bold and labelled
/// `split here`, and the nodes sit in two filled clusters, `edge` (stages `[0, k)`) and
/// `server` (stages `[k, N)`); a module that cut k falls inside is unfolded so the cut shows.
/// A cut past the last one (N) marks nothing.
pub fn stage_graph_dot(bundle: &Bundle, chosen_cut: Option<usize>) -> String {
    let manifest = bundle.manifest();
    let n = bundle.stage_count();
    let chosen = chosen_cut.filter(|&k| k <= n);
    let groups = stage_groups(&manifest.stages, chosen);

    let mut dot = String::new();
    // Writing into a String cannot fail, hence the ignored results below.
    let _ = writeln!(dot, "digraph stage_graph {{");
    let mut title = format!("{} ({} stages, {} parameters", manifest.model.source, n, thousands(manifest.model.parameters));
    if let Some(k) = chosen {
        let _ = write!(title, ", split at cut {k}");
    }
    title.push(')');
    let _ = writeln!(dot, "  label={};", quote(&title));
    let _ = writeln!(dot, "  labelloc=t;");
    let _ = writeln!(dot, "  rankdir=TB;");
    let _ = writeln!(dot, "  node [shape=box, style=\"rounded,filled\", fillcolor=\"{PLAIN_FILL}\"];");
    let _ = writeln!(dot);

    let inputs: Vec<String> =
        manifest.inputs.iter().flat_map(|input| input.spec.tensor_leaves(&input.name)).map(|(name, spec)| format!("{name}: {spec}")).collect();
    let input_label = if inputs.is_empty() { "input".to_string() } else { format!("input\n{}", inputs.join("\n")) };
    let _ = writeln!(dot, "  input [label={}, shape=ellipse, style=solid];", quote(&input_label));
    let _ = writeln!(dot, "  output [label=\"output\", shape=ellipse, style=solid];");

    match chosen {
        None => {
            for group in &groups {
                let _ = writeln!(dot, "  {}", node_line(&manifest.stages, group, None));
            }
        }
        Some(k) => {
            let (edge, server): (Vec<&StageGroup>, Vec<&StageGroup>) = groups.iter().partition(|g| g.stages.end <= k);
            for (side, fill, members, range) in [("edge", EDGE_FILL, &edge, 0..k), ("server", SERVER_FILL, &server, k..n)] {
                if members.is_empty() {
                    continue;
                }
                let _ = writeln!(dot, "  subgraph cluster_{side} {{");
                let _ = writeln!(dot, "    label={};", quote(&format!("{side}: stages [{}, {})", range.start, range.end)));
                let _ = writeln!(dot, "    style=\"rounded,filled\";");
                let _ = writeln!(dot, "    color=\"#999999\";");
                let _ = writeln!(dot, "    fillcolor=\"#ffffff\";");
                for group in members.iter() {
                    let _ = writeln!(dot, "    {}", node_line(&manifest.stages, group, Some(fill)));
                }
                let _ = writeln!(dot, "  }}");
            }
        }
    }
    let _ = writeln!(dot);

    // One edge per cut between nodes: cut 0 enters the first node, cut N leaves the last.
    let mut previous = "input".to_string();
    let mut boundaries: Vec<(usize, String)> = groups.iter().map(|g| (g.stages.start, node_id(g))).collect();
    boundaries.push((n, "output".to_string()));
    for (cut, next) in boundaries {
        let _ = writeln!(dot, "  {previous} -> {next} [{}];", edge_attributes(bundle, cut, chosen == Some(cut)));
        previous = next;
    }
    let _ = writeln!(dot, "}}");
    dot
}

/// A node's DOT statement: its id, its label (name, stage range, parameters, FLOPs per
/// sample) and, on a chosen split, the fill of its side.
fn node_line(stages: &[StageInfo], group: &StageGroup, fill: Option<&str>) -> String {
    let covered = &stages[group.stages.clone()];
    let parameters: u64 = covered.iter().map(|s| s.parameters).sum();
    let flops: u64 = covered.iter().map(|s| s.flops_per_sample).sum();
    let range = if group.stages.len() == 1 {
        format!("stage {}", group.stages.start)
    } else {
        format!("stages [{}, {})", group.stages.start, group.stages.end)
    };
    let label = format!("{}\n{range}\n{} params\n{} FLOPs/sample", group.label, thousands(parameters), si(flops));
    let fill = fill.map(|f| format!(", fillcolor=\"{f}\"")).unwrap_or_default();
    format!("{} [label={}{fill}];", node_id(group), quote(&label))
}

/// The DOT attributes of the edge crossing `cut`.
fn edge_attributes(bundle: &Bundle, cut: usize, chosen: bool) -> String {
    let info = bundle.cut(cut);
    let mut label = String::new();
    if chosen {
        label.push_str("split here\n");
    }
    let _ = write!(label, "cut {cut}\n{}/sample", human_bytes(info.bytes_per_sample));
    if info.bytes_fixed > 0 {
        let _ = write!(label, " + {}", human_bytes(info.bytes_fixed));
    }
    let tensors = info.tensors().len();
    if tensors > 1 {
        let _ = write!(label, "\n{tensors} tensors");
    }
    if !info.usable {
        label.push_str("\nnot usable");
    }
    let mut attributes = format!("label={}", quote(&label));
    if chosen {
        attributes.push_str(", color=red, fontcolor=red, penwidth=3, style=bold");
    } else if !info.usable {
        attributes.push_str(", style=dashed");
    }
    attributes
}

/// A node's id: its stage range, unique because groups never overlap.
fn node_id(group: &StageGroup) -> String {
    format!("stages_{}_{}", group.stages.start, group.stages.end)
}

/// `s` as a DOT double-quoted string: quotes and backslashes escaped, newlines as `\n`
/// (centred lines).
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => {}
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The path a stage is folded by: its name, or the first end of a merged range
/// (`getattr_1 .. to`).
fn stage_path(stage: &StageInfo) -> &str {
    stage.name.split(" .. ").next().unwrap_or(&stage.name)
}

/// The first `depth` components of a stage path, where `.` separates submodules and `:`
/// an operation inside a module (`layer1.0:add` is `layer1`, `layer1.0`, `layer1.0:add`).
/// A path with fewer components is returned whole.
fn path_prefix(path: &str, depth: usize) -> &str {
    path.match_indices(['.', ':']).nth(depth.saturating_sub(1)).map_or(path, |(at, _)| &path[..at])
}

/// The nodes of the graph: runs of consecutive stages with the same top-level module, where
/// the run that `chosen` falls strictly inside is unfolded one level deeper, recursively.
fn stage_groups(stages: &[StageInfo], chosen: Option<usize>) -> Vec<StageGroup> {
    let mut groups = Vec::new();
    fold(stages, 0..stages.len(), 1, chosen, &mut groups);
    groups
}

/// Folds `range` into runs of stages whose paths share their first `depth` components,
/// appending them to `out`; a run with the chosen cut strictly inside is folded again one
/// level deeper, or split into single stages when its paths have no deeper level.
fn fold(stages: &[StageInfo], range: Range<usize>, depth: usize, chosen: Option<usize>, out: &mut Vec<StageGroup>) {
    let mut start = range.start;
    while start < range.end {
        let key = path_prefix(stage_path(&stages[start]), depth);
        let mut end = start + 1;
        while end < range.end && path_prefix(stage_path(&stages[end]), depth) == key {
            end += 1;
        }
        let run = start..end;
        match chosen {
            Some(k) if run.start < k && k < run.end => {
                let deeper = stages[run.clone()].iter().any(|s| path_prefix(stage_path(s), depth + 1) != path_prefix(stage_path(s), depth));
                if deeper {
                    fold(stages, run, depth + 1, chosen, out);
                } else {
                    // The same path on both sides of the cut (one module called twice in a
                    // row): only single stages can show it.
                    out.extend(run.map(|i| StageGroup { label: stages[i].name.clone(), stages: i..i + 1 }));
                }
            }
            _ => {
                // A single stage shows its full name (a merged range included).
                let label = if run.len() == 1 { stages[run.start].name.clone() } else { key.to_string() };
                out.push(StageGroup { label, stages: run });
            }
        }
        start = end;
    }
}

/// Renders `dot` into an SVG file at `out` with Graphviz's `dot -Tsvg`. Returns `Ok(true)`
/// when written, `Ok(false)` when `dot` is not installed (nothing is written then), and an
/// error naming `out` when `dot` fails.
pub fn render_svg(dot: &str, out: &Path) -> Result<bool, io::Error> {
    render_svg_with(OsStr::new("dot"), dot, out)
}

/// [`render_svg`] with the Graphviz program given, so a test can name one that is missing.
fn render_svg_with(program: &OsStr, dot: &str, out: &Path) -> Result<bool, io::Error> {
    let mut child =
        match Command::new(program).arg("-Tsvg").arg("-o").arg(out).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn() {
            Ok(child) => child,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io::Error::new(e.kind(), format!("running dot for {}: {e}", out.display()))),
        };
    let named = |e: io::Error| io::Error::new(e.kind(), format!("running dot for {}: {e}", out.display()));
    // dot reads its whole input before it writes, and its stderr is a few warnings at most,
    // so writing everything before reading stderr cannot deadlock.
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(dot.as_bytes()).map_err(named)?;
    }
    let output = child.wait_with_output().map_err(named)?;
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "dot -Tsvg failed for {} ({}): {}",
            out.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(true)
}

/// Writes [`STAGE_GRAPH_DOT`] into `dir` (created when needed) and, when Graphviz is
/// installed, [`STAGE_GRAPH_SVG`] next to it. Returns both paths, the SVG's only when written.
pub fn write_stage_graph(bundle: &Bundle, chosen: Option<usize>, dir: &Path) -> io::Result<(PathBuf, Option<PathBuf>)> {
    std::fs::create_dir_all(dir).map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", dir.display())))?;
    let dot = stage_graph_dot(bundle, chosen);
    let dot_path = dir.join(STAGE_GRAPH_DOT);
    std::fs::write(&dot_path, &dot).map_err(|e| io::Error::new(e.kind(), format!("writing {}: {e}", dot_path.display())))?;
    let svg_path = dir.join(STAGE_GRAPH_SVG);
    let svg = render_svg(&dot, &svg_path)?.then_some(svg_path);
    Ok((dot_path, svg))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_bundle(name: &str) -> Bundle {
        let root =
            std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/test-bundles").to_string());
        let dir = Path::new(&root).join(name);
        Bundle::open(&dir).unwrap_or_else(|e| panic!("test bundle {} (run `make test-bundles`): {e}", dir.display()))
    }

    /// Checks the DOT's structure without Graphviz: a digraph whose braces and quotes
    /// balance outside strings, and whose edges join declared nodes. Returns the node labels
    /// by id and the edge statements.
    fn parse(dot: &str) -> (Vec<(String, String)>, Vec<String>) {
        assert!(dot.starts_with("digraph "), "not a digraph: {}", &dot[..dot.len().min(40)]);
        let (mut depth, mut in_string, mut escaped) = (0i64, false, false);
        for c in dot.chars() {
            match (in_string, escaped, c) {
                (true, true, _) => escaped = false,
                (true, false, '\\') => escaped = true,
                (true, false, '"') => in_string = false,
                (false, _, '"') => in_string = true,
                (false, _, '{') => depth += 1,
                (false, _, '}') => {
                    depth -= 1;
                    assert!(depth >= 0, "a '}}' closes nothing");
                }
                _ => {}
            }
        }
        assert!(!in_string, "unterminated string");
        assert_eq!(depth, 0, "unbalanced braces");
        assert!(dot.trim_end().ends_with('}'));

        let mut nodes = Vec::new();
        let mut edges = Vec::new();
        for line in dot.lines().map(str::trim) {
            if line.contains(" -> ") {
                edges.push(line.to_string());
            } else if let Some((id, rest)) = line.split_once(" [label=\"") {
                if !id.contains(' ') && id != "node" {
                    let label = rest.split("\"").next().unwrap().to_string();
                    nodes.push((id.to_string(), label));
                }
            }
        }
        for edge in &edges {
            let (from, rest) = edge.split_once(" -> ").unwrap();
            let to = rest.split_whitespace().next().unwrap();
            for end in [from, to] {
                assert!(nodes.iter().any(|(id, _)| id == end), "edge {edge:?} joins undeclared node {end:?}");
            }
        }
        (nodes, edges)
    }

    /// The first line of each node's label (its module name), in order of declaration.
    fn names(nodes: &[(String, String)]) -> Vec<String> {
        nodes.iter().map(|(_, label)| label.split("\\n").next().unwrap().to_string()).collect()
    }

    #[test]
    fn resnet18_folds_to_top_level_modules() {
        let bundle = test_bundle("resnet18");
        let dot = stage_graph_dot(&bundle, None);
        let (nodes, edges) = parse(&dot);
        let names = names(&nodes);
        assert_eq!(names, ["input", "output", "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "flatten", "fc"]);
        // One edge per cut between nodes: input, 11 module boundaries, output.
        assert_eq!(edges.len(), 12);
        assert!(!dot.contains("split here") && !dot.contains("color=red") && !dot.contains("cluster_"));
        // layer1 is stages [4, 18) with the parameters of its stages.
        let layer1 = &nodes.iter().find(|(_, l)| l.starts_with("layer1\\n")).unwrap().1;
        let params: u64 = bundle.manifest().stages[4..18].iter().map(|s| s.parameters).sum();
        assert!(layer1.contains("stages [4, 18)") && layer1.contains(&format!("{} params", thousands(params))), "{layer1}");
        // Cut 4 enters layer1 with 64 KiB per sample; a residual cut inside shows 2 tensors.
        assert!(edges.iter().any(|e| e.starts_with("stages_3_4 -> stages_4_18 [label=\"cut 4\\n64.0 KiB/sample\"]")), "{edges:?}");
        let every_cut = stage_graph_dot(&bundle, Some(5));
        assert!(every_cut.contains("cut 5\\n128.0 KiB/sample\\n2 tensors"), "{every_cut}");
    }

    #[test]
    fn chosen_cut_inside_layer2_unfolds_it_and_marks_one_red_edge() {
        let bundle = test_bundle("resnet18");
        // Cut 26 lies between layer2.0 (stages 18..26) and layer2.1: one level is enough.
        let dot = stage_graph_dot(&bundle, Some(26));
        let (nodes, edges) = parse(&dot);
        let names = names(&nodes);
        assert!(names.contains(&"layer2.0".to_string()) && names.contains(&"layer2.1".to_string()), "{names:?}");
        assert!(!names.contains(&"layer2".to_string()), "{names:?}");
        for module in ["conv1", "layer1", "layer3", "layer4", "fc"] {
            assert!(names.contains(&module.to_string()), "{module} missing from {names:?}");
        }
        assert_eq!(dot.matches("split here").count(), 1);
        assert_eq!(dot.matches(", color=red").count(), 1);
        let red: Vec<_> = edges.iter().filter(|e| e.contains("color=red")).collect();
        assert!(red[0].starts_with("stages_18_26 -> stages_26_33"), "{red:?}");
        assert!(red[0].contains("cut 26"), "{red:?}");
        assert!(dot.contains("subgraph cluster_edge") && dot.contains("subgraph cluster_server"));
        assert!(dot.contains("edge: stages [0, 26)") && dot.contains("server: stages [26, 66)"));
        // Edge-side nodes are filled with the edge's colour, server-side with the server's.
        let fill_of = |id: &str| {
            let line = dot.lines().find(|l| l.trim_start().starts_with(&format!("{id} [label="))).unwrap();
            if line.contains(EDGE_FILL) {
                "edge"
            } else if line.contains(SERVER_FILL) {
                "server"
            } else {
                "none"
            }
        };
        assert_eq!(fill_of("stages_4_18"), "edge");
        assert_eq!(fill_of("stages_18_26"), "edge");
        assert_eq!(fill_of("stages_26_33"), "server");
        assert_eq!(fill_of("stages_65_66"), "server");

        // Cut 25 lies inside layer2.0 (before its last relu): that block unfolds too.
        let dot = stage_graph_dot(&bundle, Some(25));
        let (nodes, _) = parse(&dot);
        let names = super::tests::names(&nodes);
        assert!(names.contains(&"layer2.0:ops".to_string()) && names.contains(&"layer2.1".to_string()), "{names:?}");
        assert_eq!(dot.matches("split here").count(), 1);
    }

    #[test]
    fn chosen_cut_at_the_ends_marks_the_input_or_output_edge() {
        let bundle = test_bundle("resnet18");
        let dot = stage_graph_dot(&bundle, Some(0));
        let (_, edges) = parse(&dot);
        let red: Vec<_> = edges.iter().filter(|e| e.contains("split here")).collect();
        assert_eq!(red.len(), 1);
        assert!(red[0].starts_with("input -> "), "{red:?}");
        assert!(!dot.contains("cluster_edge") && dot.contains("cluster_server"));

        let n = bundle.stage_count();
        let dot = stage_graph_dot(&bundle, Some(n));
        let (_, edges) = parse(&dot);
        let red: Vec<_> = edges.iter().filter(|e| e.contains("split here")).collect();
        assert_eq!(red.len(), 1);
        assert!(red[0].contains("-> output"), "{red:?}");

        // A cut past N marks nothing.
        assert!(!stage_graph_dot(&bundle, Some(n + 1)).contains("split here"));
    }

    #[test]
    fn digits_graph_with_and_without_a_cut() {
        let bundle = test_bundle("digits");
        let (nodes, edges) = parse(&stage_graph_dot(&bundle, None));
        assert_eq!(names(&nodes), ["input", "output", "features", "classifier"]);
        assert_eq!(edges.len(), 3);
        assert_eq!(nodes[0].1, "input\\nx: float32[B, 1, 8, 8]");

        let dot = stage_graph_dot(&bundle, Some(4));
        let (nodes, edges) = parse(&dot);
        let names = names(&nodes);
        assert_eq!(&names[2..], ["features.0", "features.1", "features.2", "features.3", "features.4", "features.5", "features.6", "classifier"]);
        assert_eq!(edges.len(), 9);
        assert_eq!(dot.matches("split here").count(), 1);
        assert!(edges.iter().any(|e| e.starts_with("stages_3_4 -> stages_4_5") && e.contains("split here")));

        // A cut between the two top-level modules unfolds nothing.
        let dot = stage_graph_dot(&bundle, Some(7));
        let (nodes, _) = parse(&dot);
        assert_eq!(super::tests::names(&nodes)[2..], ["features", "classifier"]);
    }

    #[test]
    fn every_cut_of_every_test_bundle_gives_a_well_formed_graph() {
        for name in ["resnet18", "digits", "transformer", "efficientnet_b0", "mobilenet_v3_small", "bn_dropout"] {
            let bundle = test_bundle(name);
            for k in 0..=bundle.stage_count() {
                let dot = stage_graph_dot(&bundle, Some(k));
                let (_, edges) = parse(&dot);
                assert_eq!(dot.matches("split here").count(), 1, "{name} cut {k}");
                let red = edges.iter().find(|e| e.contains("split here")).unwrap();
                assert!(red.contains(&format!("\\ncut {k}\\n")), "{name} cut {k}: {red}");
            }
        }
    }

    #[test]
    fn path_prefixes() {
        assert_eq!(path_prefix("layer1.0:add", 1), "layer1");
        assert_eq!(path_prefix("layer1.0:add", 2), "layer1.0");
        assert_eq!(path_prefix("layer1.0:add", 3), "layer1.0:add");
        assert_eq!(path_prefix("layer1.0:add", 4), "layer1.0:add");
        assert_eq!(path_prefix("fc", 1), "fc");
        assert_eq!(si(999), "999");
        assert_eq!(si(75_497_472), "75.5 M");
        assert_eq!(quote("a \"b\"\\\nc"), "\"a \\\"b\\\"\\\\\\nc\"");
    }

    #[test]
    fn render_svg_without_dot_is_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("graph.svg");
        let missing = OsStr::new("cleave-no-such-graphviz-program");
        assert!(!render_svg_with(missing, "digraph g { a -> b }", &out).unwrap());
        assert!(!out.exists());
    }

    #[test]
    fn render_svg_and_write_stage_graph_follow_whether_dot_is_installed() {
        let installed = Command::new("dot").arg("-V").output().is_ok();
        let bundle = test_bundle("digits");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("graphs");
        let (dot_path, svg_path) = write_stage_graph(&bundle, Some(4), &out).unwrap();
        assert_eq!(dot_path, out.join(STAGE_GRAPH_DOT));
        assert_eq!(std::fs::read_to_string(&dot_path).unwrap(), stage_graph_dot(&bundle, Some(4)));
        assert_eq!(svg_path.is_some(), installed);
        if let Some(svg_path) = svg_path {
            let svg = std::fs::read_to_string(svg_path).unwrap();
            assert!(svg.contains("<svg") && svg.contains("split here"));
            // Graphviz refuses broken input, and the error names the file.
            let err = render_svg("digraph {", &dir.path().join("broken.svg")).unwrap_err();
            assert!(err.to_string().contains("broken.svg"), "{err}");
        } else {
            assert!(!out.join(STAGE_GRAPH_SVG).exists());
        }
    }
}
