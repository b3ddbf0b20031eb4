//! Every problem code the layer can answer is in `docs/problems.md`, with
//! the status it is sent with and the gRPC status a gRPC caller gets: a
//! new code cannot go undocumented.

use idem_layer::ProblemCode;

#[test]
fn every_problem_code_is_documented_with_its_status() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/problems.md"
    ))
    .expect("docs/problems.md");
    for code in ProblemCode::ALL {
        let name = format!("`{}`", code.as_str());
        let row = doc
            .lines()
            .find(|line| line.starts_with('|') && line.contains(&name))
            .unwrap_or_else(|| panic!("{name} is not in docs/problems.md"));
        let status = format!("| {} |", code.status().as_u16());
        assert!(
            row.starts_with(&status),
            "{name} is sent with {}, the docs say: {row}",
            code.status()
        );
        let grpc = idem_layer::grpc::status_for(*code);
        let grpc = format!(
            "{name} | `{}` |",
            idem_layer::grpc::status_name(grpc).expect("a gRPC status")
        );
        assert!(
            row.contains(&grpc),
            "{name} is sent to gRPC callers as {grpc}, the docs say: {row}"
        );
    }
}
