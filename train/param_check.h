// The parameter registry meets the optimizer table: the startup check that every registered parameter
// is in kParamTable and kWorkOrder exactly once (upstream asserts the same), and the lookups from a
// table row to its registry entry. Part of train_gpt.cu: included after its optimizer table.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

// Why the optimizer table, the work order and the registry disagree, or "" when every registered
// parameter has exactly one table row and one place in the work order (upstream asserts the same at
// startup). An empty name is a missing work-order entry.
std::string param_table_error(const std::vector<std::string>& registry, const std::vector<std::string>& table,
                              const std::vector<std::string>& order) {
    std::string out;
    for (const auto& [what, names] : {std::pair{"kParamTable", &table}, std::pair{"kWorkOrder", &order}}) {
        for (size_t i = 0; i < names->size(); ++i) {
            const std::string& name = (*names)[i];
            if (name.empty()) out += std::string(what) + " entry " + std::to_string(i) + " is empty; ";
            else if (std::find(registry.begin(), registry.end(), name) == registry.end())
                out += std::string(what) + " names '" + name + "', which is no registered parameter; ";
            else if (std::find(names->begin(), names->begin() + i, name) != names->begin() + i)
                out += std::string(what) + " names '" + name + "' twice; ";
        }
        for (const std::string& name : registry)
            if (std::find(names->begin(), names->end(), name) == names->end())
                out += std::string(what) + " lacks the registered parameter '" + name + "'; ";
    }
    return out.empty() ? out : out.substr(0, out.size() - 2);
}

// This program's table, work order and registry checked against each other; stops naming the difference.
void check_param_table(const Config& c) {
    Params unplaced{};
    std::vector<std::string> registry, table, order;
    for (const ParamEntry& e : param_entries(c, unplaced)) registry.push_back(e.spec.name);
    for (const ParamRule& r : kParamTable) table.push_back(r.label);
    for (const char* label : kWorkOrder) order.push_back(label ? label : "");
    if (const std::string e = param_table_error(registry, table, order); !e.empty()) {
        std::fprintf(stderr, "train_gpt: the parameter registry, kParamTable and kWorkOrder disagree: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
}

int param_group(const char* label) {
    for (int i = 0; i < kParamGroups; ++i)
        if (std::strcmp(kParamTable[i].label, label) == 0) return i;
    std::fprintf(stderr, "train_gpt: no parameter group '%s'\n", label);
    std::exit(EXIT_FAILURE);
}

// A parameter as the optimizer sees it: `rows` entries along dim 0 (NorMuon: matrices) of
// `row_elems` elements each; sharded parameters are split along dim 0.
struct ParamTensor {
    void *param, *grad;
    bool fp32;
    int64_t rows, row_elems;
    int mat_rows = 0, mat_cols = 0;  // NorMuon's matrix shape
};
// The registry entry of a table row, in the parameter and the gradient arena.
ParamTensor param_tensor(const Config& c, Params& p, Params& g, const ParamRule& rule) {
    const std::vector<ParamEntry> params = param_entries(c, p), grads = param_entries(c, g);
    for (size_t i = 0; i < params.size(); ++i) {
        const std::vector<int64_t>& shape = params[i].spec.shape;
        if (params[i].spec.name != std::string(rule.label)) continue;
        ParamTensor t{params[i].data, grads[i].data, params[i].fp32, shape[0], params[i].elems() / shape[0]};
        if (rule.optim == Optim::normuon) {
            t.mat_rows = int(shape.at(1));
            t.mat_cols = int(shape.at(2));
        }
        return t;
    }
    std::fprintf(stderr, "train_gpt: kParamTable's '%s' is no registered parameter\n", rule.label);
    std::exit(EXIT_FAILURE);
}
