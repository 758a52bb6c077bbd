// The parameter registry against the optimizer table and the work order: the program's own three
// agree, and each planted disagreement (a missing, an unknown, a repeated or an empty name) is
// named; the placed registry matches the arenas (parameters and gradients at the same offsets,
// every registered tensor inside its arena, the optimizer's view of each group from its shape); a
// toy parameter added as the README's editing guide says (one registry line, one table row, one
// work-order entry) is laid out after the others in both arenas and passes the startup check.
#include "../trainer_under_test.h"
#include "../test_util.h"

std::vector<std::string> registry_names(const Config& c) {
    Params unplaced{};
    std::vector<std::string> out;
    for (const ParamEntry& e : param_entries(c, unplaced)) out.push_back(e.spec.name);
    return out;
}
std::vector<std::string> table_labels(const Config& c) {
    std::vector<std::string> out;
    for (const ParamRule& r : c.param_table) out.push_back(r.label);
    return out;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

void check_table_agreement(const Config& c) {
    const std::vector<std::string> reg = registry_names(c), table = table_labels(c), order = c.work_order;
    const std::string ok = param_table_error(reg, table, order);
    test::check(ok.empty(), "the program's registry, table and work order agree (got: %s)", ok.c_str());
    const size_t k = size_t(test::randint(0, int(reg.size()) - 1));
    const std::string victim = reg[k];

    std::vector<std::string> t = table;
    t.erase(std::find(t.begin(), t.end(), victim));
    std::string e = param_table_error(reg, t, order);
    test::check(contains(e, "param_table lacks the registered parameter '" + victim + "'"), "a missing table row is named: %s",
                e.c_str());
    t = table;
    t.push_back("toy_" + victim);
    e = param_table_error(reg, t, order);
    test::check(contains(e, "param_table names 'toy_" + victim + "', which is no registered parameter"),
                "an unknown table label is named: %s", e.c_str());
    std::vector<std::string> o = order;
    o[k] = o[(k + 1) % o.size()];
    e = param_table_error(reg, table, o);
    test::check(contains(e, "work_order names '" + o[k] + "' twice") && contains(e, "work_order lacks the registered parameter '" + order[k] + "'"),
                "a repeated work-order entry is named with the one it displaced: %s", e.c_str());
    o = order;
    o[k] = "";  // an empty label
    e = param_table_error(reg, table, o);
    test::check(contains(e, "work_order entry " + std::to_string(k) + " is empty") &&
                    contains(e, "work_order lacks the registered parameter '" + order[k] + "'"),
                "an empty work-order entry is named: %s", e.c_str());
    std::vector<std::string> r = reg;
    r.push_back("toy_param");
    e = param_table_error(r, table, order);
    test::check(contains(e, "param_table lacks the registered parameter 'toy_param'") &&
                    contains(e, "work_order lacks the registered parameter 'toy_param'"),
                "a registered parameter without a table row and a place in the work order is named: %s", e.c_str());
}

void check_placed_registry(Model& m) {
    const Config& c = m.cfg;
    const std::vector<ParamEntry> params = param_entries(c, m.params), grads = param_entries(c, m.grads);
    const char* pbase = static_cast<const char*>(m.param_arena.base());
    const char* gbase = static_cast<const char*>(m.grad_arena.base());
    size_t bytes = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        const ParamEntry& p = params[i];
        const size_t at = size_t(static_cast<const char*>(p.data) - pbase), n = size_t(p.elems()) * (p.fp32 ? 4 : 2);
        test::check(static_cast<const char*>(grads[i].data) - gbase == static_cast<ptrdiff_t>(at),
                    "%s: its gradient sits at its offset in the gradient arena", p.spec.name);
        test::check(at + n <= m.param_arena.bytes() && at >= bytes, "%s: inside the arena, after the one before", p.spec.name);
        bytes = at + n;
    }
    for (const ParamRule& rule : c.param_table) {
        const ParamTensor t = param_tensor(c, m.params, m.grads, rule);
        const auto e = std::find_if(params.begin(), params.end(), [&](const ParamEntry& x) { return x.spec.name == std::string(rule.label); });
        test::check(e != params.end() && t.param == e->data && t.rows * t.row_elems == e->elems() && t.fp32 == e->fp32,
                    "%s: the optimizer's view is the registered tensor", rule.label);
        if (rule.optim == Optim::normuon)
            test::check(int64_t(t.mat_rows) * t.mat_cols == t.row_elems, "%s: NorMuon's matrices tile each row", rule.label);
    }
    test::check(params.size() == c.param_table.size(), "one table row per registered parameter");
}

// The program's parameters plus one toy parameter, registered as the editing guide adds one.
struct ToyParams {
    Params base;
    bf16* toy_scale = nullptr;
};
template <class Visit>
void visit_toy_params(const Config& c, ToyParams& p, Visit&& visit) {
    visit_params(c, p.base, visit);
    visit(ParamSpec{"toy_scale", {1, c.model_dim}, Init::zeros}, p.toy_scale);
}
void layout_toy_params(Arena& a, const Config& c, ToyParams& p) {
    visit_toy_params(c, p, [&](const ParamSpec& spec, auto*& field) {
        field = a.take<std::remove_reference_t<decltype(*field)>>(spec.name, spec.shape);
    });
}

void check_toy_parameter(const Config& c) {
    Arena params("parameters"), grads("gradients");
    ToyParams p, g;
    place(params, [&](Arena& a) { layout_toy_params(a, c, p); });
    place(grads, [&](Arena& a) { layout_toy_params(a, c, g); });
    const std::vector<ParamEntry> base = param_entries(c, p.base);
    const char* scalars_end = static_cast<const char*>(base.back().data) + base.back().elems() * 4;
    const ptrdiff_t at = reinterpret_cast<const char*>(p.toy_scale) - static_cast<const char*>(params.base());
    test::check(p.toy_scale != nullptr && reinterpret_cast<const char*>(p.toy_scale) >= scalars_end &&
                    size_t(at) + size_t(c.model_dim) * 2 <= params.bytes(),
                "the toy parameter is placed after the registered ones, inside the arena");
    test::check(reinterpret_cast<const char*>(g.toy_scale) - static_cast<const char*>(grads.base()) == at,
                "the toy parameter's gradient sits at its offset in the gradient arena");
    std::vector<std::string> reg = registry_names(c), table = table_labels(c), order = c.work_order;
    reg.push_back("toy_scale");
    test::check(!param_table_error(reg, table, order).empty(), "the registered toy parameter needs a table row");
    table.push_back("toy_scale");
    order.insert(order.begin() + test::randint(0, int(order.size())), "toy_scale");
    const std::string e = param_table_error(reg, table, order);
    test::check(e.empty(), "with its table row and work-order entry the toy parameter passes the check (got: %s)", e.c_str());
}

// Record 80's residual stream: its lambdas' rows, at upstream's hyperparameters, in upstream's order.
void check_record80_rows(const Config& c) {
    const std::vector<std::string> table = table_labels(c);
    const std::vector<std::string> want = {"post_lambdas", "x0_lambdas", "bigram_lambdas", "resid_lambdas"};
    const auto at = std::search(table.begin(), table.end(), want.begin(), want.end());
    test::check(at != table.end(), "record 80's lambdas are consecutive rows in upstream's order");
    const double lr_mul[] = {1.0, 1.0, 1.0, 5.0};
    for (size_t i = 0; i < want.size() && at != table.end(); ++i) {
        const ParamRule& r = c.param_table[size_t(at - table.begin()) + i];
        test::check(r.optim == Optim::adam && r.reduce == Reduce::replicated && r.beta1 == 0.9 && r.beta2 == 0.95 &&
                        r.lr_mul == lr_mul[i] && r.wd_mul == 0.0,
                    "%s: Adam (0.9, 0.95), lr x%g, no decay, all-reduced", r.label, lr_mul[i]);
    }
}

int main() {
    test::seed();
    Config r80 = tiny_preset();
    use_record80_residual_stream(r80);
    check_record80_rows(r80);
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    for (const Config& c : {tiny_preset(), r80}) {
        std::printf("%s:\n", c.structure.sublayer_lambdas ? "record 80's residual stream" : "tiny");
        check_table_agreement(c);
        check_toy_parameter(c);
        Model m;
        build_model(m, c, test::seed(), s);
        check_placed_registry(m);
    }
    CUDA_CHECK(cudaStreamDestroy(s));
    return test::finish();
}
