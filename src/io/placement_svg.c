/* SPDX-License-Identifier: MIT */
/* placement_svg.c — who holds which expert, and one token's way (placement_svg.h). */
#include "moe/placement_svg.h"

#include <stdlib.h>
#include <string.h>

#include "moe/common.h"

enum {
    SQUARE = 16,    /* an expert */
    GAP = 3,        /* between experts */
    PER_ROW = 8,    /* experts a row of a rank's box */
    RANK_MIN = 84,  /* a rank's box at least this wide (its label) */
    RANK_GAP = 12,  /* between ranks of a node */
    RANKS_ACROSS = 4,
    NODE_PAD = 12,  /* inside a node's box */
    NODE_HEAD = 22, /* its label */
    NODE_GAP = 26,  /* between nodes */
    NODES_ACROSS = 4,
    TOP = 92,       /* title, legend and room for the arrows over the first row */
};

static int rank_of(const moe_placement_picture *p, int expert)
{
    int r = 0;
    while (r < p->ranks - 1 && p->first_expert[r + 1] <= expert)
        r++;
    return r;
}

int moe_placement_arrows(const moe_placement_picture *p, int *from, int *to, int *ib)
{
    const int G = p->ranks, R = p->ranks_per_node, home = p->home, nodes = (G + R - 1) / R;
    bool *hit = moe_xcalloc((size_t)G, sizeof(bool));
    for (int s = 0; s < p->k && p->token >= 0; s++)
        if (p->chosen[s] >= 0)
            hit[rank_of(p, p->chosen[s])] = true;
    int n = 0;
    for (int node = 0; node < nodes; node++) { /* IB: flat, a row to each rank; two stages, to the relay */
        if (node == home / R)
            continue;
        for (int r = node * R; r < (node + 1) * R && r < G; r++) {
            if (!hit[r])
                continue;
            from[n] = home, to[n++] = p->two_stage ? node * R + home % R : r;
            if (p->two_stage)
                break;
        }
    }
    *ib = n;
    for (int r = 0; r < G; r++) { /* NVLink: from home within its node, from the relay within others */
        const int relay = r / R == home / R ? home : p->two_stage ? r / R * R + home % R : -1;
        if (hit[r] && relay >= 0 && r != relay)
            from[n] = relay, to[n++] = r;
    }
    free(hit);
    return n;
}

typedef struct {
    int rank_w, rank_h, node_w, node_h, nodes;
} geometry;

static geometry geometry_of(const moe_placement_picture *p)
{
    int most = 0;
    for (int r = 0; r < p->ranks; r++)
        most = p->first_expert[r + 1] - p->first_expert[r] > most ? p->first_expert[r + 1] - p->first_expert[r] : most;
    const int across = most < PER_ROW ? (most > 0 ? most : 1) : PER_ROW, rows = (most + PER_ROW - 1) / PER_ROW;
    geometry g;
    g.rank_w = 10 + across * (SQUARE + GAP);
    g.rank_w = g.rank_w < RANK_MIN ? RANK_MIN : g.rank_w;
    g.rank_h = 22 + (rows > 0 ? rows : 1) * (SQUARE + GAP) + 4;
    const int R = p->ranks_per_node, cols = R < RANKS_ACROSS ? R : RANKS_ACROSS;
    g.node_w = 2 * NODE_PAD + cols * g.rank_w + (cols - 1) * RANK_GAP;
    g.node_h = NODE_HEAD + NODE_PAD + ((R + cols - 1) / cols) * (g.rank_h + RANK_GAP);
    g.nodes = (p->ranks + R - 1) / R;
    return g;
}

/* The top-left corner of rank r's box. */
static void rank_at(const moe_placement_picture *p, const geometry *g, int r, int *x, int *y)
{
    const int R = p->ranks_per_node, cols = R < RANKS_ACROSS ? R : RANKS_ACROSS, n = r / R, l = r % R;
    const int nx = 20 + (n % NODES_ACROSS) * (g->node_w + NODE_GAP);
    const int ny = TOP + (n / NODES_ACROSS) * (g->node_h + NODE_GAP);
    *x = nx + NODE_PAD + (l % cols) * (g->rank_w + RANK_GAP);
    *y = ny + NODE_HEAD + (l / cols) * (g->rank_h + RANK_GAP);
}

static void legend(FILE *out, int x, int y)
{
    fprintf(out,
            "<g font-size=\"11\">\n"
            "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#d62728\" stroke-width=\"3\"/>"
            "<text x=\"%d\" y=\"%d\">a row over IB (between nodes)</text>\n"
            "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#2ca02c\" stroke-width=\"2\"/>"
            "<text x=\"%d\" y=\"%d\">a row over NVLink (within a node)</text>\n"
            "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"#ff9f1c\" stroke=\"#555\"/>"
            "<text x=\"%d\" y=\"%d\">an expert the token chose</text>\n"
            "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"#dbe8f6\" stroke=\"#555\" "
            "stroke-dasharray=\"3,2\"/><text x=\"%d\" y=\"%d\">a copy (an expert held twice or more)</text>\n"
            "</g>\n",
            x, y, x + 28, y, x + 34, y + 4, x + 230, y, x + 258, y, x + 264, y + 4, x + 480, y - 6, x + 498,
            y + 4, x + 660, y - 6, x + 678, y + 4);
}

void moe_write_placement_svg(FILE *out, const moe_placement_picture *p)
{
    const geometry g = geometry_of(p);
    const int G = p->ranks, R = p->ranks_per_node;
    const int across = g.nodes < NODES_ACROSS ? g.nodes : NODES_ACROSS;
    const int width = 40 + across * g.node_w + (across - 1) * NODE_GAP;
    const int height = TOP + ((g.nodes + NODES_ACROSS - 1) / NODES_ACROSS) * (g.node_h + NODE_GAP) + 10;
    const int min_width = 900;
    fprintf(out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "font-family=\"sans-serif\">\n"
            "<defs>\n"
            "<marker id=\"ib-head\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"5\" "
            "markerHeight=\"5\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"#d62728\"/></marker>\n"
            "<marker id=\"nvlink-head\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"6\" "
            "markerHeight=\"6\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"#2ca02c\"/></marker>\n"
            "</defs>\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
            "<text x=\"20\" y=\"24\" font-size=\"15\" font-weight=\"bold\">%s</text>\n",
            width > min_width ? width : min_width, height, width > min_width ? width : min_width, height,
            p->title);
    legend(out, 24, 50);
    /* nodes, ranks, experts */
    int *copies = NULL;
    if (p->logical) {
        int most = 0;
        for (int e = 0; e < p->experts; e++)
            most = p->logical[e] > most ? p->logical[e] : most;
        copies = moe_xcalloc((size_t)most + 1, sizeof(int));
        for (int e = 0; e < p->experts; e++)
            copies[p->logical[e]]++;
    }
    for (int n = 0; n < g.nodes; n++) {
        int x, y;
        rank_at(p, &g, n * R, &x, &y);
        fprintf(out,
                "<g class=\"node\"><rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" rx=\"8\" fill=\"#f3f3f3\" "
                "stroke=\"#999\"/><text x=\"%d\" y=\"%d\" font-size=\"12\" font-weight=\"bold\">node %d</text></g>\n",
                x - NODE_PAD, y - NODE_HEAD, g.node_w, g.node_h - RANK_GAP, x - NODE_PAD + 8, y - NODE_HEAD + 15, n);
    }
    for (int r = 0; r < G; r++) {
        int x, y;
        rank_at(p, &g, r, &x, &y);
        fprintf(out,
                "<g class=\"rank\"><rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" rx=\"4\" fill=\"white\" "
                "stroke=\"%s\" stroke-width=\"%s\"/><text x=\"%d\" y=\"%d\" font-size=\"11\">rank %d%s</text></g>\n",
                x, y, g.rank_w, g.rank_h, r == p->home && p->token >= 0 ? "#000" : "#555",
                r == p->home && p->token >= 0 ? "2.5" : "1", x + 5, y + 14, r,
                r == p->home && p->token >= 0 ? " (home)" : "");
        for (int e = p->first_expert[r]; e < p->first_expert[r + 1]; e++) {
            const int l = e - p->first_expert[r];
            const int ex = x + 5 + (l % PER_ROW) * (SQUARE + GAP), ey = y + 20 + (l / PER_ROW) * (SQUARE + GAP);
            bool chosen = false;
            for (int s = 0; s < p->k && p->token >= 0; s++)
                chosen = chosen || p->chosen[s] == e;
            const int logical = p->logical ? p->logical[e] : e;
            const bool copy = copies && copies[logical] > 1;
            fprintf(out,
                    "<g class=\"expert%s%s\"><rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" "
                    "stroke=\"#555\"%s/><text x=\"%d\" y=\"%d\" font-size=\"8\" text-anchor=\"middle\">%d</text></g>\n",
                    chosen ? " chosen" : "", copy ? " copy" : "", ex, ey, SQUARE, SQUARE,
                    chosen ? "#ff9f1c" : "#dbe8f6", copy ? " stroke-dasharray=\"3,2\"" : "", ex + SQUARE / 2,
                    ey + SQUARE / 2 + 3, logical);
        }
    }
    free(copies);
    /* the token's rows: curves from the top of one rank's box to another's */
    int *from = moe_xmalloc(sizeof(int) * (size_t)(2 * G + 1)), *to = moe_xmalloc(sizeof(int) * (size_t)(2 * G + 1));
    int ib;
    const int arrows = moe_placement_arrows(p, from, to, &ib);
    for (int a = 0; a < arrows; a++) {
        int x0, y0, x1, y1;
        rank_at(p, &g, from[a], &x0, &y0);
        rank_at(p, &g, to[a], &x1, &y1);
        const bool over_ib = a < ib;
        /* IB arrows leave from the box's top, NVLink ones from its middle, so both show */
        x0 += g.rank_w / 2 + (over_ib ? -8 : 8);
        x1 += g.rank_w / 2 + (over_ib ? -8 : 8);
        y0 += over_ib ? 0 : g.rank_h / 2;
        y1 += over_ib ? 0 : g.rank_h / 2;
        const int lift = over_ib ? 40 + abs(x1 - x0) / 8 : 18 + abs(x1 - x0) / 10;
        int top = (y0 < y1 ? y0 : y1) - lift;
        /* the curve's highest point, (y0 + y1) / 4 + top / 2, stays under the legend */
        const int lowest = 2 * (TOP - 22) - (y0 + y1) / 2;
        top = top < lowest ? lowest : top;
        fprintf(out,
                "<path class=\"%s\" d=\"M%d,%d Q%d,%d %d,%d\" fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" "
                "marker-end=\"url(#%s-head)\" opacity=\"0.9\"/>\n",
                over_ib ? "ib" : "nvlink", x0, y0, (x0 + x1) / 2, top, x1, y1, over_ib ? "#d62728" : "#2ca02c",
                over_ib ? "3" : "2", over_ib ? "ib" : "nvlink");
    }
    free(to);
    free(from);
    fprintf(out, "</svg>\n");
}
